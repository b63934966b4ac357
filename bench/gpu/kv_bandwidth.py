"""KV + handoff-row write bandwidth from one GPU to another through pdserve's NIXL transport,
next to raw NIXL (the same bytes between two flat buffers, at the best of a few descriptor
counts, posted a copy per descriptor or as one scatter-gather list) between the same GPUs, on
the Llama-3.1-8B KV shape (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token;
16-token pages).

The receiving side runs in a child process (as a decode node would), so the copy crosses
processes exactly as in serving: CUDA IPC over NVLink between two GPUs, or within one GPU.
`measure(src, dst)` returns, per prompt length, the transport's and raw NIXL's GB/s and ratio:
medians of rounds that time every variant once in turn (the transport's write with and without
the handoff row, to scattered pages, and posted as one scatter-gather list (--kv-write-sgl on);
raw NIXL at several descriptor counts, both ways, and built and notified per write), so no
variant is timed only while the link or the GPUs are cold.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
import torch

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
TOKENS = (1024, 8192)
ROUNDS = 12  # each variant timed this many times, interleaved with the others
RAW_SPLITS = (1, 4, 16, 64)
SGL_SPLITS = (1, 64)  # raw NIXL posting its descriptors as one scatter-gather list
SGL = ("off", "on")  # --kv-write-sgl of the transports compared
BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
ROW_PAYLOAD = 4096  # about an EAGLE handoff row of an 8B model (top-k + a 4096-wide hidden state)


def _endpoint(
    name: str, device: str, max_tokens: int, rows_device: str
) -> tuple[dict[str, Any], Any, dict[str, Any], torch.Tensor]:
    """Our transport over an 8B-shaped pool, plus a raw NIXL agent over one flat buffer, each
    twice: writes posted a copy per descriptor ("off") and as one scatter-gather list ("on")."""
    from engine.kv_cache import KVPool
    from engine.kv_transfer import HandoffRows, create_transport

    pool = KVPool(LAYERS, max_tokens // PAGE + 2, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    # "kv": beside the KV, where nodes keep them by default (engine/kv_transfer/endpoint.py);
    # "cpu": in host memory (--kv-handoff-rows host), a second stage
    rows = HandoffRows(ROW_PAYLOAD, 4, device=device if rows_device == "kv" else rows_device)
    flat = torch.empty(max_tokens * BYTES_PER_TOKEN, dtype=torch.uint8, device=device)
    transports = {sgl: create_transport("nixl", f"bw-{name}-sgl-{sgl}", [pool], rows, sgl=sgl) for sgl in SGL}
    return transports, (pool, rows), {sgl: _raw_agent(f"raw-{name}-sgl-{sgl}", flat, sgl == "on") for sgl in SGL}, flat


def _raw_agent(name: str, flat: torch.Tensor, sgl: bool) -> Any:
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    from engine.kv_transfer.nixl import create_backend

    raw = nixl_agent(name, nixl_agent_config(backends=[]))
    create_backend(raw, "UCX", {}, sgl)
    raw.register_memory([(flat.data_ptr(), flat.numel(), max(flat.get_device(), 0), "")], _mem(flat))
    return raw


def _mem(t: torch.Tensor) -> str:
    return "VRAM" if t.is_cuda else "DRAM"


def _receiver(conn: Any, device: str, max_tokens: int, rows_device: str) -> None:
    transports, keep, raws, flat = _endpoint("recv", device, max_tokens, rows_device)
    transport, raw = transports["off"], raws["off"]  # how a write is posted is the writer's affair
    conn.send(
        (
            transport.metadata(),
            transport.layout(),
            bytes(raw.get_agent_metadata()),
            flat.data_ptr(),
            max(flat.get_device(), 0),
        )
    )
    while not conn.poll(0.0005):  # a receiver drives its agents' progress, as a decode node does
        transport.drain_notifications()
        raw.get_new_notifs()
    for t in transports.values():
        t.close()
    del keep


def _wait(poll: Any, done: Any) -> None:
    while True:
        state = poll()
        if done(state):
            return
        time.sleep(0)


def _once_ours(
    transport: Any, peer: str, room: int, pages: list[int], dst: list[int], row: bool, posts: list[float] | None = None
) -> float:
    """One write through the transport, posted and polled to its end on this thread: the KV
    pages, and with `row` the handoff row (the final write of a request, which notifies).
    `posts` collects how long `write` itself took (building and posting the request)."""
    from engine.kv_transfer import KVPoll, TransferRequest

    t0 = time.perf_counter()
    h = transport.write(TransferRequest(room, peer, pages, dst, 1 if row else None, 1 if row else None))
    if posts is not None:
        posts.append(time.perf_counter() - t0)
    _wait(lambda: transport.poll(h), lambda s: s is not KVPoll.TRANSFERRING)
    took = time.perf_counter() - t0
    assert transport.poll(h) is KVPoll.SUCCESS, transport.last_error(h)
    transport.release(h)
    return took


def _raw_descs(raw: Any, flat: torch.Tensor, remote: tuple[int, int], nbytes: int, splits: int) -> tuple[Any, Any]:
    """`nbytes` of one flat buffer and of the peer's, cut into `splits` equal descriptors (UCX
    spreads descriptors over several CUDA streams: more can be faster)."""
    step = nbytes // splits
    offs = np.arange(splits, dtype=np.uint64) * np.uint64(step)
    dev = max(flat.get_device(), 0)

    def rows(base: Any, d: int) -> Any:
        return np.stack([base + offs, np.full(splits, step, np.uint64), np.full(splits, d, np.uint64)], axis=1)

    return (
        raw.get_xfer_descs(rows(np.uint64(flat.data_ptr()), dev), _mem(flat)),
        raw.get_xfer_descs(rows(np.uint64(remote[0]), remote[1]), _mem(flat)),
    )


def _once_raw(raw: Any, peer: str, descs: tuple[Any, Any], one_off: bool) -> float:
    """One raw NIXL WRITE. `one_off`: timed as a KV write must run, from building the request to
    completion, with a notification for the receiver (a KV write is never the same request twice);
    otherwise the request is built before the clock starts and notifies no one."""
    t_setup = time.perf_counter()
    h = raw.initialize_xfer("WRITE", descs[0], descs[1], peer, b"done" if one_off else b"")
    t0 = t_setup if one_off else time.perf_counter()
    if raw.transfer(h) != "DONE":
        _wait(lambda: raw.check_xfer_state(h), lambda s: s != "PROC")
    took = time.perf_counter() - t0
    h.release()
    return took


def _interleaved(variants: dict[str, Any]) -> dict[str, float]:
    """Median seconds of each variant over ROUNDS rounds that run every variant once, in turn
    (so a drift of the link's or the GPUs' speed weighs on all alike); round 0 is a warm-up."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(ROUNDS + 1):
        for name, once in variants.items():
            took = once(r)
            if r:
                times[name].append(took)
    return {name: statistics.median(t) for name, t in times.items()}


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _report(t: dict[str, float], nbytes: int, total: int, posts: list[float]) -> dict[str, Any]:
    """GB/s and ratios of one prompt length from the variants' median seconds `t`."""
    raw_by_split = {str(n): t[f"raw{n}"] for n in RAW_SPLITS}
    raw_sgl = {str(n): t[f"raw_sgl{n}"] for n in SGL_SPLITS}
    raw_s = min(*raw_by_split.values(), *raw_sgl.values())
    one_off = {str(n): t[f"one_off{n}"] for n in (1, 64)}
    ours, sgl, scattered = t["ours"], t["ours_sgl"], t["scattered"]
    gb_s = lambda n, sec: n / sec / 1e9  # noqa: E731
    return {
        "kv_bytes": nbytes,
        "kv_plus_row_bytes": total,
        "ours_s": ours,
        "ours_gb_s": gb_s(total, ours),
        "ours_kv_only_gb_s": gb_s(nbytes, t["ours_kv_only"]),
        "ours_post_s": statistics.median(posts[1:]),  # building + posting the request
        "ours_scattered_pages_s": scattered,
        "ours_scattered_pages_gb_s": gb_s(total, scattered),
        # the same writes posted as one scatter-gather list each (--kv-write-sgl on)
        "ours_sgl_s": sgl,
        "ours_sgl_gb_s": gb_s(total, sgl),
        "ours_sgl_scattered_pages_gb_s": gb_s(total, t["scattered_sgl"]),
        "raw_nixl_s": raw_s,
        "raw_nixl_gb_s": gb_s(nbytes, raw_s),
        "raw_nixl_gb_s_by_descriptors": {n: gb_s(nbytes, x) for n, x in raw_by_split.items()},
        "raw_nixl_sgl_gb_s_by_descriptors": {n: gb_s(nbytes, x) for n, x in raw_sgl.items()},
        "ratio_vs_raw": gb_s(total, ours) / gb_s(nbytes, raw_s),
        "ratio_sgl_vs_raw": gb_s(total, sgl) / gb_s(nbytes, raw_s),
        # raw NIXL timed like a KV write: request built per write, receiver notified
        "raw_one_off_notified_gb_s_by_descriptors": {n: gb_s(nbytes, x) for n, x in one_off.items()},
        "ratio_vs_raw_one_off_notified": gb_s(total, ours) / gb_s(nbytes, min(one_off.values())),
        "ratio_vs_raw_scattered_pages": gb_s(total, scattered) / gb_s(nbytes, raw_s),
    }


def measure(src: str, dst: str, tokens_list: tuple[int, ...] = TOKENS, rows_device: str = "cpu") -> dict[str, Any]:
    """Per prompt length, our write's and raw NIXL's GB/s; `rows_device` "kv" puts the handoff
    rows beside the KV (one NIXL stage per write, as nodes do by default), "cpu" in host memory."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, dst, max(tokens_list), rows_device), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):  # bounded: a receiver that died at start-up must not hang the run
            raise RuntimeError(f"the receiving process did not start (exit code {proc.exitcode})")
        md, layout, raw_md, raddr, rdev = parent.recv()
        transports, keep, raws, flat = _endpoint("send", src, max(tokens_list), rows_device)
        peers = {k: t.add_peer(md, layout) for k, t in transports.items()}
        raw_peers = {k: _as_str(raw.add_remote_agent(raw_md)) for k, raw in raws.items()}
        out: dict[str, Any] = {}
        for tokens in tokens_list:
            nbytes = tokens * BYTES_PER_TOKEN
            pages = list(range(1, tokens // PAGE + 1))
            shuffled = [int(x) for x in np.random.default_rng(0).permutation(pages)]
            descs = {
                k: {n: _raw_descs(raw, flat, (raddr, rdev), nbytes, n) for n in RAW_SPLITS} for k, raw in raws.items()
            }
            posts: list[float] = []
            ours, sgl = transports["off"], transports["on"]
            once_raw = lambda k, n, one_off: lambda r: _once_raw(raws[k], raw_peers[k], descs[k][n], one_off)  # noqa: E731
            t = _interleaved(
                {
                    "ours": lambda r: _once_ours(ours, peers["off"], 2 * r + 1, pages, pages, True, posts),
                    "ours_kv_only": lambda r: _once_ours(ours, peers["off"], 2 * r + 2, pages, pages, False),
                    "scattered": lambda r: _once_ours(ours, peers["off"], 1000 + r, pages, shuffled, True),
                    "ours_sgl": lambda r: _once_ours(sgl, peers["on"], 3000 + r, pages, pages, True),
                    "scattered_sgl": lambda r: _once_ours(sgl, peers["on"], 4000 + r, pages, shuffled, True),
                    # raw NIXL at its best: the fastest of a few descriptor counts and both ways of posting
                    **{f"raw{n}": once_raw("off", n, False) for n in RAW_SPLITS},
                    **{f"raw_sgl{n}": once_raw("on", n, False) for n in SGL_SPLITS},
                    **{f"one_off{n}": once_raw("off", n, True) for n in (1, 64)},
                }
            )
            out[str(tokens)] = _report(t, nbytes, nbytes + keep[1].row_bytes, posts)
            row = out[str(tokens)]
            print(
                f"{tokens} tokens: ours {row['ours_gb_s']:.1f} GB/s (one SGL {row['ours_sgl_gb_s']:.1f}, scattered "
                f"pages {row['ours_scattered_pages_gb_s']:.1f}), raw NIXL {row['raw_nixl_gb_s']:.1f} GB/s, ratio "
                f"{row['ratio_vs_raw']:.2f} (SGL {row['ratio_sgl_vs_raw']:.2f})",
                flush=True,
            )
        for transport in transports.values():
            transport.close()
        return out
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
