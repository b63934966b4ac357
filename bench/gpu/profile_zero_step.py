"""Where a 0-step EAGLE decode step spends its time next to a plain decode step (same model, batch).

`python -m bench.gpu.profile_zero_step llama-1b OUT` (GPU machine; `batches=1,8,64`): for each
batch size, the plain engine and an EAGLE engine pinned at 0 steps (the target alone, the draft
catching up when its ring is full) decode the same prompts under the profiler. Per decode step: wall
time, host time inside `Engine.step`, GPU kernel time, GPU busy time (union of kernel intervals),
kernel count, and the kernels by name, so the difference between the two is itemized (catch-up
kernels are averaged over the steps they serve); with `host`, also a cProfile of the host side of
each decode phase. Writes OUT/profile_zero_step_<model>.json.
"""

from __future__ import annotations

import gc
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.common import write_report
from bench.gpu.profile_step import cuda_kernel_stats
from bench.gpu.spec_speedup import (
    MODELS,
    NEW_TOKENS,
    engine_for,
    prompts_for,
    release_memory,
    synthetic_setup,
    timed_decode,
)
from engine.core import SamplingParams
from engine.engine import Engine

HOST = False  # `host` on the command line: also a cProfile of each decode phase


class GcTimer:
    """Time spent in the garbage collector, by generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self.runs, self._t0 = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.runs[info["generation"]] += 1

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def profiled_decode(eng: Engine, prompts: list[list[int]]) -> dict[str, Any]:
    """Prefill unprofiled, then the decode phase under the profiler; figures per decode step."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    rids = {eng.add_request(p, params) for p in prompts}
    first: set[str] = set()
    while len(first) < len(rids):
        first.update(d.rid for d in eng.step() if d.token_ids)
    torch.cuda.synchronize()
    steps, host = 0, 0.0
    with profile(activities=[ProfilerActivity.CUDA]) as prof, GcTimer() as gct:
        t0 = time.perf_counter()
        while not eng.idle:
            h0 = time.perf_counter()
            eng.step()
            host += time.perf_counter() - h0
            steps += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per_name, busy, _ = cuda_kernel_stats(prof, steps)
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {
        "steps": steps,
        "wall_us_per_step": wall / steps * 1e6,
        "host_us_per_step": host / steps * 1e6,
        "gc_us_per_step": gct.seconds / steps * 1e6,
        "gc_runs": gct.runs,
        "kernel_us_per_step": sum(t for t, _ in per_name.values()),
        "kernels_per_step": sum(c for _, c in per_name.values()),
        "busy_us_per_step": busy,
        "kernels": {n[:100]: [round(t, 2), round(c, 2)] for n, (t, c) in top},
    }


def host_profile(eng: Engine, prompts: list[list[int]], top: int = 45) -> list[str]:
    """cProfile of the decode phase (prefill unprofiled): where the host's time per step goes."""
    import cProfile
    import io
    import pstats

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    rids = {eng.add_request(p, params) for p in prompts}
    first: set[str] = set()
    while len(first) < len(rids):
        first.update(d.rid for d in eng.step() if d.token_ids)
    prof = cProfile.Profile()
    prof.enable()
    while not eng.idle:
        eng.step()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue().splitlines()


def timed_parts(eng: Engine, prompts: list[list[int]]) -> dict[str, float]:
    """Host microseconds per decode step inside the scheduler's parts and the executor's calls
    (perf_counter around each: no profiler overhead), the wait for the device included in collect."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    rids = {eng.add_request(p, params) for p in prompts}
    first: set[str] = set()
    while len(first) < len(rids):
        first.update(d.rid for d in eng.step() if d.token_ids)
    sched, ex = eng.scheduler, eng.executor
    spent: dict[str, float] = defaultdict(float)
    patched = {
        "launch": (ex, ex.launch),
        "collect": (ex, ex.collect),
        "next_batch": (sched.policy, sched.policy.next_batch),
        "complete": (sched, sched._complete),
        "ingest": (sched, sched._ingest),
    }

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0

        return call

    for name, (obj, fn) in patched.items():
        setattr(obj, name, timed(name, fn))
    steps, t0 = 0, time.perf_counter()
    try:
        while not eng.idle:
            eng.step()
            steps += 1
    finally:
        for name, (obj, _) in patched.items():
            delattr(obj, name)
    spent["total"] = time.perf_counter() - t0
    return {k: round(v / steps * 1e6, 1) for k, v in spent.items()}


def diff(plain: dict[str, Any], zero: dict[str, Any]) -> list[dict[str, Any]]:
    """Kernels whose per-step time or count differs, largest time difference first."""
    names = set(plain["kernels"]) | set(zero["kernels"])
    rows = []
    for n in names:
        pt, pc = plain["kernels"].get(n, [0.0, 0.0])
        zt, zc = zero["kernels"].get(n, [0.0, 0.0])
        if abs(zt - pt) > 0.3 or abs(zc - pc) > 0.05:
            rows.append({"name": n, "us": round(zt - pt, 2), "count": round(zc - pc, 2)})
    return sorted(rows, key=lambda r: -abs(r["us"]))


def main() -> int:
    global HOST
    HOST = "host" in sys.argv[1:]
    names = [a for a in sys.argv[1:] if a in MODELS] or ["llama-1b"]
    sizes = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("batches=")]
    rest = [a for a in sys.argv[1:] if a not in MODELS and a != "host" and not a.startswith("batches=")]
    batches = tuple(int(b) for b in sizes[0].split(",")) if sizes else (1, 8, 64)
    out = Path(rest[0]) if rest else Path("bench/results")
    for name in names:
        cfg, model, head, zero_config, picker = synthetic_setup(name)
        report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "model": name, "points": []}
        results: dict[str, dict[int, Any]] = {"plain": {}, "zero": {}}
        for label in results:
            eng = engine_for(
                model,
                cfg,
                head if label == "zero" else None,
                1 if label == "zero" else None,
                zero_config if label == "zero" else None,
            )
            for bs in batches:
                ps = prompts_for(bs, cfg.vocab_size)
                warm = timed_decode(eng, ps)  # warm-up pass (and the oracle's table for the draft)
                for p, o in zip(ps, warm["outputs"]):
                    picker.sequences.setdefault(tuple(p), p + o)
                results[label][bs] = r = profiled_decode(eng, ps)
                if HOST:
                    r["host_profile"] = host_profile(eng, ps)
                    r["host_parts_us"] = timed_parts(eng, ps)
                    print(name, label, bs, "host us per step:", r["host_parts_us"], flush=True)
                print(
                    name,
                    label,
                    bs,
                    {k: round(v, 1) for k, v in r.items() if not isinstance(v, (dict, list))},
                    flush=True,
                )
            del eng
            release_memory()
        for bs in batches:
            p, z = results["plain"][bs], results["zero"][bs]
            point = {"batch": bs, "plain": p, "zero": z, "diff": diff(p, z)}
            report["points"].append(point)
            print(
                f"{name} bs {bs}: wall {p['wall_us_per_step']:.0f} -> {z['wall_us_per_step']:.0f} us, busy "
                f"{p['busy_us_per_step']:.0f} -> {z['busy_us_per_step']:.0f}, kernels {p['kernels_per_step']:.1f} -> "
                f"{z['kernels_per_step']:.1f}",
                flush=True,
            )
            for row in point["diff"][:30]:
                print("   ", row, flush=True)
        write_report(out / f"profile_zero_step_{name}.json", report)
        del model
        release_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
