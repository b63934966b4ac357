"""Kernel-level breakdown of a batch-1 decode step on a Llama-3.1-8B-shaped model (random bf16).

`python -m bench.gpu.profile_step` (GPU machine). Times the CUDA-graph decode step at batch 1 and
1K context against the weight-read roofline for three set-ups in one process: cuBLAS linears
(no GEMV), the Triton GEMV, and the GEMV with programmatic dependent launch; profiles each and
lists per-step kernel time by kernel name, plus the step time not covered by any kernel.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.common import write_report
from bench.gpu import step_perf
from bench.gpu.hw import copy_bandwidth
from bench.gpu.llama8b import build_engine_model, shape_config, weight_read_bytes
from bench.gpu.rig import decode_step_fn, make_rig, step_context
from engine import pdl as pdl_mod
from engine.core import ForwardMode
from engine.layers import gemv as gemv_mod

VARIANTS = {"cublas": (0, "0"), "gemv": (gemv_mod.MAX_ROWS, "0"), "gemv_pdl": (gemv_mod.MAX_ROWS, "1")}


def cuda_kernel_stats(prof: Any, steps: int) -> tuple[dict[str, list[float]], float, float]:
    """From a finished torch profiler: per kernel name [us per step, launches per step], the GPU's
    busy time per step (the union of kernel intervals) and the span from first to last kernel."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    spans = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per_name[ev.name][0] += ev.device_time / steps
        per_name[ev.name][1] += 1 / steps
        spans.append((ev.time_range.start, ev.time_range.end))
    if not spans:
        return dict(per_name), 0.0, 0.0
    spans.sort()
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return dict(per_name), busy / steps, (spans[-1][1] - spans[0][0]) / steps


def profiled_kernels(fn: Any, steps: int) -> tuple[dict[str, list[float]], float, float]:
    """`steps` calls of fn under the CUDA profiler: cuda_kernel_stats of them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return cuda_kernel_stats(prof, steps)


def kernel_table(fn: Any, steps: int) -> dict[str, Any]:
    per_name, busy, span = profiled_kernels(fn, steps)
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "kernels_per_step": sum(c for _, c in per_name.values()),
        "kernel_us_per_step": sum(t for t, _ in per_name.values()),
        "busy_us_per_step": busy,
        "span_us_per_step": span,
        "top": [{"name": n[:90], "us": round(t, 1), "count": round(c, 1)} for n, (t, c) in top],
    }


def measure(
    model: torch.nn.Module,
    cfg: Any,
    dev: torch.device,
    bw: float,
    wbytes: int,
    context: int,
    tokens: dict[str, torch.Tensor],
    name: str,
) -> dict[str, Any]:
    rig = make_rig(model, cfg, dev, max_reqs=8, max_context=context + 64, total_tokens=8 * (context + 64))
    rig.runner.enable_cuda_graphs(8)
    entry = step_perf.decode_roofline(rig, cfg, bw, wbytes, 1, context, iters=50)
    ids, ctx = step_context(rig, ForwardMode.DECODE, 1, context)
    fn = decode_step_fn(rig, ids, ctx)
    tokens[name] = fn()
    entry["profile"] = kernel_table(fn, 10)
    entry["verify"] = step_perf.verify_vs_decode(rig, 1, context, 5)
    entry["graphs"] = step_perf.graph_counters(rig)
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results/profile_step.json")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    _, cfg = shape_config()
    model = build_engine_model(cfg, dev)
    wbytes = weight_read_bytes(model)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "copy_bandwidth_tb_s": bw / 1e12}
    tokens = {}
    for name, (max_rows, pdl) in VARIANTS.items():
        gemv_mod.MAX_ROWS = max_rows
        os.environ["PDSERVE_PDL"] = pdl
        pdl_mod._device_supports_pdl.cache_clear()
        try:
            report[name] = entry = measure(model, cfg, dev, bw, wbytes, args.context, tokens, name)
        except Exception as e:  # noqa: BLE001 - device time is scarce: report and go on
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(name, report[name], flush=True)
            continue
        print(name, {k: v for k, v in entry.items() if k != "profile"}, flush=True)
        print("  ", {k: v for k, v in entry["profile"].items() if k != "top"}, flush=True)
        for row in entry["profile"]["top"][:14]:
            print("    ", row, flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    if "cublas" in tokens:
        report["same_greedy_token"] = {n: bool(torch.equal(t, tokens["cublas"])) for n, t in tokens.items()}
    write_report(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
