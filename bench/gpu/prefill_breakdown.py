"""Where a long prompt's forward goes on the 8B shape, by kind of kernel, with the prompt
attention kernel and with the paged extend kernel, in one process.

`python -m bench.gpu.prefill_breakdown --out OUT/prefill_breakdown.json` (GPU machine). For each
prompt length: the forward's time and fraction of the measured matmul rate (bench/gpu/step_perf.py's
definition), then one profiled forward split by kind of kernel (bench/gpu/engine_perf.py's kinds), with the
GPU's busy time and the forward's span.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.common import write_report
from bench.gpu import step_perf
from bench.gpu.engine_perf import kernel_kind
from bench.gpu.hw import burst_and_held, graphed, matmul_rate, sustained_matmul_rate, time_cuda
from bench.gpu.llama8b import build_engine_model, shape_config
from bench.gpu.profile_step import profiled_kernels
from bench.gpu.rig import Rig, decode_step_fn, make_rig, step_context
from engine.core import ForwardMode


def breakdown(rig: Rig, tokens: int, steps: int = 3) -> dict[str, Any]:
    """One profiled prompt forward (+ last-token logits) split by kind of kernel, per forward."""
    ids, ctx = step_context(rig, ForwardMode.EXTEND, 1, tokens, tokens)
    fn = decode_step_fn(rig, ids, ctx, logits_rows=slice(-1, None))
    fn()
    per_name, busy, span = profiled_kernels(fn, steps)
    by_kind: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_name.items():
        by_kind[kernel_kind(name)] += us
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "ms_by_kind": {k: round(v / 1e3, 3) for k, v in by_kind.items()},
        "busy_ms": round(busy / 1e3, 3),
        "span_ms": round(span / 1e3, 3),
        "top_us": {n[:80]: round(t, 1) for n, (t, _) in top},
    }


def gemm_rates(dev: torch.device, tokens: int, cfg: Any) -> dict[str, Any]:
    """Each of a layer's GEMMs alone at `tokens` rows: TFLOP/s over a short burst (as the
    matmul rate is measured) and over about a second (as long as a benchmark's prompts run)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = {"qkv": (qkv, h), "o": (h, cfg.num_heads * cfg.head_dim), "gate_up": (2 * inter, h), "down": (h, inter)}
    out: dict[str, Any] = {}
    for name, (n, k) in shapes.items():
        x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        flop = 2 * tokens * n * k
        burst, sustained = burst_and_held(lambda: torch.nn.functional.linear(x, w))
        out[name] = {
            "burst_tflops": round(flop / burst / 1e12, 1),
            "sustained_tflops": round(flop / sustained / 1e12, 1),
        }
    return out


def suffix_times(rig: Rig, prefix: int, suffixes: list[int]) -> dict[str, float]:
    """A chunk of n tokens over `prefix` cached ones (a follow-up turn), forward and last-token
    logits replayed from a CUDA graph: what a prompt bucket of n tokens costs, n by n."""
    out = {}
    for n in suffixes:
        ids, ctx = step_context(rig, ForwardMode.EXTEND, 1, prefix + n, n)
        fn = decode_step_fn(rig, ids, ctx, logits_rows=slice(-1, None))
        fn()
        out[str(n)] = round(time_cuda(graphed(fn), iters=20) * 1e3, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefill_breakdown.json"))
    ap.add_argument("--tokens", default="2048,4096")
    args = ap.parse_args()
    dev = torch.device("cuda")
    _, cfg = shape_config()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    mm = matmul_rate(dev)
    report["matmul_tflops"] = mm / 1e12
    held = sustained_matmul_rate(dev)
    report["matmul_tflops_sustained_1s"] = held / 1e12
    report["gemms"] = {t: gemm_rates(dev, int(t), cfg) for t in args.tokens.split(",")}
    print(report, flush=True)
    model = build_engine_model(cfg, dev)
    rig = make_rig(model, cfg, dev, max_reqs=4, max_context=4096 + 64, total_tokens=4 * 4160, backend="triton")
    backend = rig.runner.attn_backend
    for tokens in (int(t) for t in args.tokens.split(",")):
        for prompt_kernel in (True, False, True):  # on again: the clocks' drift shows as on vs on
            t0 = time.perf_counter()
            backend.prompt_kernel = prompt_kernel
            key = f"prompt_{tokens}_{'prompt_kernel' if prompt_kernel else 'extend_kernel'}"
            key += "_again" if key in report else ""
            entry = step_perf.prefill_rate(rig, cfg, mm, tokens, iters=10, held_rate=held)
            entry["profile"] = breakdown(rig, tokens)
            report[key] = entry
            print(f"[{time.perf_counter() - t0:5.1f}s] {key}: {entry}", flush=True)
    report["suffix_over_2000_ms"] = suffix_times(rig, 2000, [128, 160, 192, 224, 256, 320, 384, 448, 512])
    print(report["suffix_over_2000_ms"], flush=True)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
