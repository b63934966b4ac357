"""All GPU performance goals in one run on a Llama-3.1-8B-shaped model with random bf16 weights.

Run on the GPU machine: `python -m bench.gpu.perf` (writes bench/results/gpu_perf.json). Each goal
is a ratio against a ceiling or a baseline measured in the same process. `--tiny` shrinks the model
for a quick dry run of the code (also on a CPU, with `--backend torch`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from bench.common import write_report
from bench.gpu import engine_perf, step_perf
from bench.gpu.hw import copy_bandwidth, matmul_rate, sustained_matmul_rate
from bench.gpu.llama8b import (
    build_engine_model,
    build_hf,
    shape_config,
    weight_read_bytes,
)
from bench.gpu.rig import make_rig

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=2048,
)


def section(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run one measurement; a failure is recorded and the rest of the run goes on."""
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 - device time is scarce: keep measuring the rest
        report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    print(f"[{time.perf_counter() - t0:6.1f}s] {name}: {json.dumps(report[name], default=str)[:600]}", flush=True)


def measured(report: dict[str, Any], key: str, default: float) -> float:
    """A ceiling the run measured, or `default` where its section failed (an error entry)."""
    value = report.get(key)
    return float(value) if isinstance(value, (int, float)) else default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--out", default="bench/results/gpu_perf.json")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raw, cfg = shape_config(**(TINY if args.tiny else {}))
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": {
            k: raw[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
            )
        },
    }
    if dev.type == "cuda":
        import triton

        report["triton"] = triton.__version__
        section(report, "copy_bandwidth_tb_s", lambda: copy_bandwidth(dev) / 1e12)
        section(report, "matmul_tflops", lambda: matmul_rate(dev) / 1e12)
        section(report, "matmul_tflops_sustained_1s", lambda: sustained_matmul_rate(dev) / 1e12)
    bw = measured(report, "copy_bandwidth_tb_s", 1.0) * 1e12 if dev.type == "cuda" else 1e11
    mm = measured(report, "matmul_tflops", 1.0) * 1e12 if dev.type == "cuda" else 1e11
    prompt = list(range(100, 132))
    hf = build_hf(raw, dev) if not args.skip_hf else None
    if hf is not None:
        section(report, "hf_generate_bs1_tokens_per_s", lambda: engine_perf.hf_generate_tps(hf, prompt, 128))
    model = build_engine_model(cfg, dev, weights_from=hf)
    hf = None  # free the HF copy: the engine model holds its own weights
    gc.collect()
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    wbytes = weight_read_bytes(model)
    report["weight_read_gb"] = wbytes / 1e9
    rig = make_rig(
        model, cfg, dev, max_reqs=64, max_context=4096 + 64, total_tokens=64 * 1040 + 4096, backend=args.backend
    )
    if dev.type == "cuda" and hasattr(rig.runner, "enable_cuda_graphs"):
        rig.runner.enable_cuda_graphs(64)
    section(report, "decode_bs1", lambda: step_perf.decode_roofline(rig, cfg, bw, wbytes, 1, 1024))
    section(report, "decode_bs64_ctx1k", lambda: step_perf.decode_roofline(rig, cfg, bw, wbytes, 64, 1024))
    section(report, "verify_bs1_4drafts", lambda: step_perf.verify_vs_decode(rig, 1, 1024, 5))
    held = measured(report, "matmul_tflops_sustained_1s", 0.0) * 1e12 if dev.type == "cuda" else None
    section(report, "prefill_4k", lambda: step_perf.prefill_rate(rig, cfg, mm, 4096, held_rate=held))
    section(report, "eager_vs_graph_bs1", lambda: step_perf.eager_vs_graph(rig, 1, 1024))
    report["rig_graph_counters"] = step_perf.graph_counters(rig)
    report["attention_backend"] = args.backend
    rig = None  # free the pool before the engine-level runs
    gc.collect()
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    if not args.skip_engine:
        run_engine_sections(report, model, cfg, Path(args.out).with_suffix(""), prompt, args.backend)
    write_report(Path(args.out), report)
    return 0


def run_engine_sections(
    report: dict[str, Any], model: torch.nn.Module, cfg: Any, stem: Path, prompt: list[int], backend: str
) -> None:
    graphs = 64 if torch.cuda.is_available() else 0
    for overlap in (False, True):
        name = f"engine_bs64_overlap_{'on' if overlap else 'off'}"
        trace = stem.parent / f"{stem.name}_{name}.trace.json"

        def run(overlap: bool = overlap, trace: Path = trace) -> dict[str, Any]:
            eng = engine_perf.make_engine(
                model, cfg, overlap=overlap, graphs=graphs, max_running=64, max_total_tokens=64 * 1300, backend=backend
            )
            try:
                plain = engine_perf.steady_decode(eng, 64, 1024, 60, None)
                profiled = engine_perf.steady_decode(eng, 64, 1024, 30, trace)
                bs1 = engine_perf.engine_generate_tps(eng, prompt, 128)
                return {"steady": plain, "profiled": profiled, "bs1_generate_tokens_per_s": bs1}
            finally:
                del eng
                gc.collect()
                torch.cuda.empty_cache() if torch.cuda.is_available() else None

        section(report, name, run)
    on, off = report.get("engine_bs64_overlap_on", {}), report.get("engine_bs64_overlap_off", {})
    if "steady" in on and "steady" in off:
        report["overlap_throughput_gain"] = on["steady"]["tokens_per_s"] / off["steady"]["tokens_per_s"]
    hf = report.get("hf_generate_bs1_tokens_per_s")
    if isinstance(hf, float) and "bs1_generate_tokens_per_s" in on:
        report["vs_hf_generate_bs1"] = on["bs1_generate_tokens_per_s"] / hf


if __name__ == "__main__":
    sys.exit(main())
