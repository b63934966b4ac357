"""Where a 0-step EAGLE decode step spends its time next to a plain decode step (same model, batch).

`python -m bench.gpu.profile_zero_step llama-1b OUT` (GPU machine; `batches=1,8,64`): for each
batch size, the plain engine and an EAGLE engine pinned at 0 steps (the target alone, the draft
catching up every 16 tokens) decode the same prompts under the profiler. Per decode step: wall
time, host time inside `Engine.step`, GPU kernel time, GPU busy time (union of kernel intervals), kernel count, and the kernels
by name, so the difference between the two is itemized (catch-up kernels are averaged over the
steps they serve). Writes OUT/profile_zero_step_<model>.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import spec.registry as registry
from bench.common import write_report
from bench.gpu.llama8b import build_engine_model, shape_config
from bench.gpu.spec_speedup import (MAX_RUNNING, MODELS, NEW_TOKENS, PROMPT_LEN, ZERO_ONLY, engine_for,
                                    prompts_for, release_memory, timed_decode)
from bench.gpu.synthetic import PICKER, OraclePicker, SyntheticEagle3, widen_margins
from engine.core import SamplingParams
from engine.engine import Engine
from fixtures.tiny_eagle import write_tiny_eagle_head


def _busy(spans: list[tuple[float, float]]) -> float:
    spans.sort()
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    return busy + cur_e - cur_s


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
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        while not eng.idle:
            h0 = time.perf_counter()
            eng.step()
            host += time.perf_counter() - h0
            steps += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per_name[ev.name][0] += ev.device_time / steps
        per_name[ev.name][1] += 1 / steps
        spans.append((ev.time_range.start, ev.time_range.end))
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {"steps": steps, "wall_us_per_step": wall / steps * 1e6, "host_us_per_step": host / steps * 1e6,
            "kernel_us_per_step": sum(t for t, _ in per_name.values()),
            "kernels_per_step": sum(c for _, c in per_name.values()),
            "busy_us_per_step": _busy(spans) / steps if spans else 0.0,
            "kernels": {n[:100]: [round(t, 2), round(c, 2)] for n, (t, c) in top}}


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
    names = [a for a in sys.argv[1:] if a in MODELS] or ["llama-1b"]
    sizes = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("batches=")]
    rest = [a for a in sys.argv[1:] if a not in MODELS and not a.startswith("batches=")]
    batches = tuple(int(b) for b in sizes[0].split(",")) if sizes else (1, 8, 64)
    out = Path(rest[0]) if rest else Path("bench/results")
    for name in names:
        raw, cfg = shape_config(MODELS[name])
        dev = torch.device("cuda")
        model = build_engine_model(cfg, dev)
        widen_margins(model)
        tmp = Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(json.dumps(raw))
        (tmp / "zero.json").write_text(json.dumps(ZERO_ONLY))
        head = write_tiny_eagle_head(tmp / "head", tmp, "eagle3", draft_vocab_size=min(32000, cfg.vocab_size // 2),
                                     intermediate_size=cfg.intermediate_size)
        registry.register_class("SYNTHETIC", SyntheticEagle3)
        picker = PICKER["current"] = OraclePicker(MAX_RUNNING, PROMPT_LEN + NEW_TOKENS + 96, cfg.vocab_size, dev)
        report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "model": name, "points": []}
        results: dict[str, dict[int, Any]] = {"plain": {}, "zero": {}}
        for label in results:
            eng = engine_for(model, cfg, head if label == "zero" else None, 1 if label == "zero" else None,
                             str(tmp / "zero.json") if label == "zero" else None)
            for bs in batches:
                ps = prompts_for(bs, cfg.vocab_size)
                warm = timed_decode(eng, ps)  # warm-up pass (and the oracle's table for the draft)
                for p, o in zip(ps, warm["outputs"]):
                    picker.sequences.setdefault(tuple(p), p + o)
                results[label][bs] = r = profiled_decode(eng, ps)
                print(name, label, bs, {k: round(v, 1) for k, v in r.items() if k != "kernels"}, flush=True)
            del eng
            release_memory()
        for bs in batches:
            p, z = results["plain"][bs], results["zero"][bs]
            point = {"batch": bs, "plain": p, "zero": z, "diff": diff(p, z)}
            report["points"].append(point)
            print(f"{name} bs {bs}: wall {p['wall_us_per_step']:.0f} -> {z['wall_us_per_step']:.0f} us, busy "
                  f"{p['busy_us_per_step']:.0f} -> {z['busy_us_per_step']:.0f}, kernels {p['kernels_per_step']:.1f} -> "
                  f"{z['kernels_per_step']:.1f}", flush=True)
            for row in point["diff"][:30]:
                print("   ", row, flush=True)
        write_report(out / f"profile_zero_step_{name}.json", report)
        del model
        release_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
