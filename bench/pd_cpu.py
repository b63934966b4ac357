"""CPU benchmark of PD handoff: NIXL (UCX) KV-page bandwidth and latency, and PD's added TTFT.

Run: `python -m bench.pd_cpu [--quick] [--out PATH]`.
1. Transfer: this process writes one request's pages + handoff row (NixlTransport) to a reader child
   owning the destination pool (random page ids), which stamps the completion notification with
   CLOCK_MONOTONIC (shared by both processes). In turn with each write, the same pages go to the
   same ids of a local pool in-process: "memcpy" (numpy indexing over page-sized void items = one
   memcpy per (layer, k|v, page)) and torch `index_copy_`. Done with NIXL's progress thread on (as
   shipped: it busy-polls a core per agent) and then off (a live agent cannot be paused).
2. End to end: `serve` and two `prefill` + `decode` pairs (progress thread as shipped / off via a
   sitecustomize) on the tiny demo model; streaming greedy Generate requests one at a time, the
   three setups in rotation, the other setups' nodes SIGSTOPped meanwhile. TTFT = request sent ->
   first stream chunk with tokens; PD sends both legs at once (as a router does), TTFT on decode.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import write_report
from bench.engine_cpu import DEFAULT_SHAPE, _loadavg, environment
from bench.pd_cpu_e2e import WAIT_S, bench_e2e
from engine.kv_cache import KVPool
from engine.kv_transfer import (
    HandoffRows,
    KVPoll,
    MemoryLayout,
    Region,
    TransferRequest,
    coalesce_runs,
    parse_tag,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pd_cpu.json"
# KV of a Llama-3.2-1B-sized model: 16 layers, 8 KV heads, head_dim 64, fp16, 16-token pages
# = 16 KiB per (layer, k|v, page), 32 KiB of KV per token.
POOL_SHAPE: dict[str, int] = {"layers": 16, "page_size": 16, "kv_heads": 8, "head_dim": 64}
FULL_TOKENS, QUICK_TOKENS, FULL_REPS, QUICK_REPS = (512, 2048, 8192), (512, 2048), 15, 3
E2E_LENS, E2E_FULL_REPS, E2E_QUICK_REPS = (64, 512), 21, 3
POLL_S = 1e-4  # both transfer sides poll this often (the nodes poll every 1 ms)


@contextlib.contextmanager
def progress_thread(on: bool) -> Iterator[None]:
    """Agents created inside get NIXL's progress thread on/off (nixl.py keeps the default: on)."""
    import nixl_cu13._api as api

    init, saved = api.nixl_agent_config.__init__, api.nixl_agent_config.__init__.__defaults__
    init.__defaults__ = (on,) + saved[1:]
    try:
        yield
    finally:
        init.__defaults__ = saved


def _pool(shape: dict[str, int], pages: int, value: float) -> KVPool:
    p = KVPool(shape["layers"], pages, shape["page_size"], shape["kv_heads"], shape["head_dim"], torch.float16, "cpu")
    p.buffer.fill_(value)  # fault every page in: time copies, not first touches
    return p


def _pages_np(pool: KVPool) -> np.ndarray:
    """(layers * 2, pages) numpy view whose items are whole pages (void): indexing = memcpy."""
    rows, pages = pool.buffer.shape[0] * 2, pool.buffer.shape[2]
    return (
        pool.buffer.view(torch.uint8)
        .numpy()
        .reshape(rows, pages, pool.page_bytes)
        .view(np.dtype((np.void, pool.page_bytes)))
        .reshape(rows, pages)
    )


def reader_main(spec: dict[str, Any]) -> None:
    """Child: destination pool + aux rows; reports (room, t, ok) for every completion."""
    from engine.kv_transfer.nixl import NixlTransport

    pools, aux = [_pool(spec["shape"], spec["pages"], 0.0)], HandoffRows(256, 8)
    with progress_thread(spec["prog_thread"]):
        t = NixlTransport(spec["name"], pools, aux)
    print(
        "@@ " + json.dumps({"md": base64.b64encode(t.metadata()).decode(), "layout": dataclasses.asdict(t.layout())}),
        flush=True,
    )
    expect: dict[int, dict[str, Any]] = {}
    gone = threading.Event()

    def read_stdin() -> None:  # expectations arrive just before each write; EOF = parent gone
        for line in sys.stdin:
            cmd = json.loads(line)
            expect[cmd["room"]] = cmd
        gone.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    ppid, deadline, seen, buf = os.getppid(), time.monotonic() + spec["life_s"], {}, pools[0].buffer
    while not gone.is_set() and os.getppid() == ppid and time.monotonic() < deadline:
        for _, msg in t.drain_notifications():
            kind, room, _ = parse_tag(msg)
            seen[room] = (time.monotonic(), kind)
        for room in [r for r in seen if r in expect]:
            (at, kind), cmd = seen.pop(room), expect.pop(room)
            ok = (
                kind == "done"
                and aux.room_of(cmd["row"]) == room
                and all(bool((buf[:, :, d] == cmd["stamp"]).all()) for d in cmd["check"])
            )
            print("@@ " + json.dumps({"room": room, "t": at, "ok": ok}), flush=True)
        time.sleep(POLL_S)
    t.close()


class Reader:
    """The reader child, spoken to with JSON lines (stdout pumped by a thread); killed by `close`."""

    def __init__(self, spec: dict[str, Any]) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NIXL_LOG_LEVEL="WARN")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.pd_cpu", "--reader", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(
            target=lambda: [self.lines.put(json.loads(x[3:])) for x in self.proc.stdout or () if x.startswith("@@ ")],
            daemon=True,
        ).start()
        try:
            hello = self.recv(120.0)
        except BaseException:
            self.close()
            raise
        self.metadata, lay = base64.b64decode(hello["md"]), hello["layout"]
        self.layout = MemoryLayout(
            kv=tuple(Region(**r) for r in lay["kv"]),
            aux=Region(**lay["aux"]),
            mem_type=lay["mem_type"],
            aux_mem_type=lay["aux_mem_type"],
        )

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = WAIT_S) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"reader silent for {timeout} s (exit code {self.proc.poll()})") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def bench_transfer(tokens: tuple[int, ...], reps: int, shape: dict[str, int], prog: bool) -> list[dict[str, Any]]:
    from engine.kv_transfer.nixl import NixlTransport

    ps = shape["page_size"]
    pages = 2 * max(tokens) // ps + 1  # room for scattered ids; page 0 is reserved
    src, local = _pool(shape, pages, 1.0), _pool(shape, pages, 0.0)
    src_np, local_np = _pages_np(src), _pages_np(local)
    aux, rng, room, rows = HandoffRows(256, 8), random.Random(0), 0, []
    reader = Reader(
        {
            "name": f"bench-reader-{os.getpid()}-{prog}",
            "shape": shape,
            "pages": pages,
            "life_s": 900,
            "prog_thread": prog,
        }
    )
    try:
        with progress_thread(prog):
            t = NixlTransport(f"bench-writer-{os.getpid()}-{prog}", [src], aux)
        with t:
            peer = t.add_peer(reader.metadata, reader.layout)
            for n_tok in tokens:
                n = n_tok // ps
                src_pages, regions = list(range(1, n + 1)), len(t.layout().kv)
                r: dict[str, Any] = {k: [] for k in ("handoff_s", "post_s", "memcpy_s", "index_copy_s")}
                for rep in range(reps + 1):  # rep 0: untimed warm-up
                    dst_pages, order = rng.sample(range(1, pages), n), ("nixl", "memcpy", "index_copy")
                    for which in order[rep % 3 :] + order[: rep % 3]:  # rotate who goes first
                        start = time.perf_counter()
                        if which == "memcpy":
                            local_np[:, np.array(dst_pages)] = src_np[:, 1 : n + 1]
                        elif which == "index_copy":
                            local.buffer.index_copy_(2, torch.tensor(dst_pages), src.buffer[:, :, 1 : n + 1])
                        if which != "nixl":
                            r[f"{which}_s"].append(time.perf_counter() - start)
                            continue
                        room += 1
                        stamp, row = float(room % 2000), 1 + room % 7  # stamp: exact in fp16
                        src.buffer[:, :, [src_pages[0], src_pages[-1]]] = stamp
                        aux.write(1, room, torch.zeros(256, dtype=torch.uint8))
                        reader.send(room=room, row=row, stamp=stamp, check=[dst_pages[0], dst_pages[-1]])
                        t0 = time.monotonic()  # the data moves inside write(): UCX cma copies synchronously
                        h = t.write(TransferRequest(room, peer, src_pages, dst_pages, 1, row))
                        r["post_s"].append(time.monotonic() - t0)
                        while (st := t.poll(h)) == KVPoll.TRANSFERRING and time.monotonic() < t0 + WAIT_S:
                            time.sleep(POLL_S)
                        t.release(h)
                        reply = reader.recv() if st == KVPoll.SUCCESS else {"error": t.last_error(h)}
                        if reply.get("room") != room or not reply["ok"]:
                            raise RuntimeError(f"room {room}: {st.name}, reader said {reply}")
                        r["handoff_s"].append(reply["t"] - t0)
                r = {k: v[1:] for k, v in r.items()}  # drop the warm-up
                kv_bytes = n * regions * src.page_bytes
                gbs = {k: kv_bytes / statistics.median(r[f"{k}_s"]) / 1e9 for k in ("handoff", "memcpy", "index_copy")}
                rows.append(
                    {
                        "prog_thread": prog,
                        "tokens": n_tok,
                        "pages": n,
                        "regions": regions,
                        "kv_bytes": kv_bytes,
                        "descriptors": len(coalesce_runs(src_pages, dst_pages)[2]) * regions + 1,
                        "nixl_gb_s": gbs["handoff"],
                        "memcpy_gb_s": gbs["memcpy"],
                        "index_copy_gb_s": gbs["index_copy"],
                        "ratio": gbs["handoff"] / gbs["memcpy"],
                        **r,
                        **{
                            f"{k}_p{q}_ms": 1e3 * float(np.percentile(r[f"{k}_s"], q))
                            for k in ("handoff", "post", "memcpy")
                            for q in (50, 90)
                        },
                    }
                )
    finally:
        reader.close()
    return rows


def run(
    quick: bool = False,
    *,
    e2e: bool = True,
    transfer_tokens: tuple[int, ...] | None = None,
    pool_shape: dict[str, int] | None = None,
    reps: int | None = None,
    prog_threads: tuple[bool, ...] = (True, False),
) -> dict[str, Any]:
    """Run the measurements and return the results (nothing printed or written)."""
    shape, tokens = dict(pool_shape or POOL_SHAPE), transfer_tokens or (QUICK_TOKENS if quick else FULL_TOKENS)
    reps = reps or (QUICK_REPS if quick else FULL_REPS)
    report: dict[str, Any] = {
        "benchmark": "pd_cpu",
        "quick": quick,
        "pool_shape": shape,
        "env": environment(),
        "transfer": [r for p in prog_threads for r in bench_transfer(tokens, reps, shape, p)],
    }
    if e2e:
        report["model_shape"] = DEFAULT_SHAPE
        report["e2e"] = bench_e2e(E2E_LENS, E2E_QUICK_REPS if quick else E2E_FULL_REPS, DEFAULT_SHAPE)
    report["env"]["loadavg_after"] = _loadavg()
    return report


def format_tables(report: dict[str, Any]) -> str:
    lines = [
        (
            "| request | NIXL progress thread | KV MiB | descriptors | NIXL GB/s | memcpy GB/s | torch index_copy_ "
            "GB/s | NIXL / memcpy | handoff p50 ms | handoff p90 ms | write() returns p50 ms | memcpy p50 ms |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["transfer"]:
        lines.append(
            f"| {r['tokens']} tokens ({r['pages']} pages x {r['regions']} regions) | "
            f"{'on (as shipped)' if r['prog_thread'] else 'off'} | {r['kv_bytes'] / 2**20:.0f} | "
            f"{r['descriptors']:,} | {r['nixl_gb_s']:.2f} | {r['memcpy_gb_s']:.2f} | "
            f"{r['index_copy_gb_s']:.2f} | {r['ratio']:.2f}x | {r['handoff_p50_ms']:.1f} | "
            f"{r['handoff_p90_ms']:.1f} | {r['post_p50_ms']:.1f} | {r['memcpy_p50_ms']:.1f} |"
        )
    if e := report.get("e2e"):
        lines += [
            "",
            (
                "| prompt tokens | colocated TTFT ms | PD TTFT ms | PD - colocated ms | PD / colocated "
                "| PD, progress thread off: TTFT ms | - colocated ms | / colocated | PD prefill leg done ms "
                "(on / off) | greedy tokens equal |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for key, x in e.items():
            label = "first request (PD: incl. handshake)" if key == "first" else f"median of {x['n']}"
            lines.append(
                f"| {x['tokens']}, {label} | {x['colocated_ttft_ms']:.1f} | "
                + " | ".join(
                    f"{x[f'{m}_ttft_ms']:.1f} | {x[f'{m}_minus_colocated_ms']:+.1f} | {x[f'{m}_over_colocated']:.2f}x"
                    for m in ("pd", "pd_prog_off")
                )
                + f" | {x['pd_prefill_leg_ms']:.1f} / "
                f"{x['pd_prog_off_prefill_leg_ms']:.1f} | {x['equal']}/{x['n']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(prog="python -m bench.pd_cpu", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file")
    ap.add_argument("--reader", help=argparse.SUPPRESS)  # internal: run as the transfer's reader
    args = ap.parse_args(argv)
    if args.reader:
        return reader_main(json.loads(args.reader))
    report = run(quick=args.quick)
    env = report["env"]
    print(
        f"CPU: {env['cpu']} ({env['cores']} cores, torch {env['torch']}, {env['torch_threads']} threads); KV pool "
        f"{report['pool_shape']} fp16; load average before/after: {env['loadavg_before']} / {env['loadavg_after']}\n"
    )
    print(format_tables(report))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
