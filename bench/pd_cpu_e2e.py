"""bench.pd_cpu part 2: PD against colocated through real node processes on loopback (TTFT, and that
their tokens are equal), with NIXL's progress thread on and off."""

from __future__ import annotations

import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
E2E_NEW = 8  # tokens generated per request
WAIT_S = 30.0  # bound on every single wait (reader line, transfer, node call)
# Nodes started with this sitecustomize run NIXL without its progress thread.
NO_PROG_SITE = (
    "import nixl_cu13._api as a\nd = a.nixl_agent_config.__init__.__defaults__\n"
    "a.nixl_agent_config.__init__.__defaults__ = (False,) + d[1:]\n"
)


def bench_e2e(lens: tuple[int, ...], reps: int, shape: dict[str, Any]) -> dict[str, Any]:
    import grpc
    from smg_grpc_proto import sglang_scheduler_pb2_grpc as pbg

    from fixtures.tiny_model import write_tiny_model
    from fixtures.pdkit import request
    from fixtures.procs import Node

    rng, nodes, channels, count = random.Random(1), {}, {}, [0]  # nodes: name -> Node
    modes = {"colocated": ("serve",), "pd": ("prefill", "decode"), "pd_prog_off": ("prefill_off", "decode_off")}

    def only(mode: str) -> None:  # SIGSTOP every node but this mode's (all are our children)
        for name, node in nodes.items():
            os.killpg(node.proc.pid, signal.SIGCONT if name in modes[mode] else signal.SIGSTOP)
        time.sleep(0.02)

    def timed(mode: str, ids: list[int]) -> dict[str, Any]:
        only(mode)
        count[0] += 1
        stub, pre = stubs[modes[mode][-1]], stubs.get(modes[mode][0]) if mode != "colocated" else None
        boot = nodes[modes[mode][0]].ports.get("bootstrap", 0)
        req, box = request(f"r{count[0]}", ids, count[0], boot, max_new=E2E_NEW, stream=True), {}

        def prefill_leg() -> None:
            try:
                list(pre.Generate(req, timeout=WAIT_S))
                box["t"] = time.perf_counter() - t0
            except grpc.RpcError as e:
                box["err"] = e

        th, t0, ttft, toks = threading.Thread(target=prefill_leg, daemon=True), time.perf_counter(), None, []
        if pre is not None:
            th.start()
        for r in stub.Generate(req, timeout=WAIT_S):
            if r.HasField("chunk") and r.chunk.token_ids:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                toks += list(r.chunk.token_ids)
        if pre is not None:
            th.join(WAIT_S)
            if "err" in box or th.is_alive():
                raise RuntimeError(f"{mode}: prefill leg failed: {box.get('err', 'timed out')}")
        return {"ttft": ttft, "tokens": toks, "prefill_leg": box.get("t")}

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        model = write_tiny_model(Path(tmp) / "llama", "LlamaForCausalLM", seed=0, **shape)
        (Path(tmp) / "site").mkdir()
        (Path(tmp) / "site" / "sitecustomize.py").write_text(NO_PROG_SITE)
        off_env = {"PYTHONPATH": os.pathsep.join([str(Path(tmp) / "site"), str(ROOT)])}
        common = ["--model", str(model), "--port", "0"]
        try:
            for name, args, env in [
                ("serve", ["serve"], None),
                ("prefill", ["prefill", "--bootstrap-port", "0"], None),
                ("decode", ["decode"], None),
                ("decode_off", ["decode"], off_env),
                ("prefill_off", ["prefill", "--bootstrap-port", "0"], off_env),
            ]:
                nodes[name] = Node([args[0], *common, *args[1:]], env=env)
            for node in nodes.values():
                node.wait_ready(180)
            channels = {k: grpc.insecure_channel(f"127.0.0.1:{n.ports['scheduler']}") for k, n in nodes.items()}
            stubs = {k: pbg.SglangSchedulerStub(c) for k, c in channels.items()}
            first = [rng.randrange(5, 256) for _ in range(lens[0])]  # lazy init (+ PD handshake)
            out = {"first": _summary(lens[0], {m: [timed(m, first)] for m in modes})}
            for k in lens:
                res: dict[str, list] = {m: [] for m in modes}
                for rep in range(reps + 1):  # rep 0: untimed warm-up at this length
                    ids, order = [rng.randrange(5, 256) for _ in range(k)], list(modes)
                    runs = {m: timed(m, ids) for m in order[rep % 3 :] + order[: rep % 3]}  # rotate
                    for m in modes:
                        res[m] += [runs[m]] if rep else []
                out[str(k)] = _summary(k, res)
            return out
        finally:
            for c in channels.values():
                c.close()
            for node in nodes.values():
                node.kill()  # SIGKILL ends stopped processes too


def _summary(k: int, res: dict[str, list]) -> dict[str, Any]:
    """Medians per setup, and PD vs colocated as the median of per-prompt (adjacent) pairs, which
    cancels load that drifts over the run better than a difference of medians."""
    med = {
        f"{m}_{x}_ms": 1e3 * statistics.median(r[x] or 0.0 for r in runs)
        for m, runs in res.items()
        for x in ("ttft", "prefill_leg")
    }
    for m in ("pd", "pd_prog_off"):
        pairs = [(a["ttft"], b["ttft"]) for a, b in zip(res[m], res["colocated"])]
        med[f"{m}_minus_colocated_ms"] = 1e3 * statistics.median(a - b for a, b in pairs)
        med[f"{m}_over_colocated"] = statistics.median(a / b for a, b in pairs)
    same = [all(res[m][i]["tokens"] == res["colocated"][i]["tokens"] for m in res) for i in range(len(res["pd"]))]
    return {"tokens": k, "n": len(same), "equal": sum(same), **med, **res}


__all__ = ["WAIT_S", "bench_e2e"]
