"""Where a prompt batch's time goes on the 8B shape: wall time against GPU kernel time, and the
host's hottest functions, for prompts of a few lengths (plain, and a follow-up over a cached prefix).

`python -m bench.gpu.profile_prompt --out DIR [--prompt-graph-tokens 2048] [--eagle] [--trace]`
(GPU machine). One engine (Triton attention, overlap, CUDA graphs for decode and prompt graphs up
to 512 tokens, or as many as given; with `--eagle`, the echo EAGLE head of the goodput bench),
warmed up; each case runs a one-token request five times for its wall time, once under
torch.profiler for its kernels' busy time, and once under cProfile; every case runs with prompt
graphs off (eager) and on. `--trace` also writes the graphs variant's follow-up as a Chrome trace
with Python stacks (follow_up_trace.json.gz) and its GPU's idle gaps with the host functions
that ran in them (`gaps`; bench/gpu/trace_gaps.py).
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.gpu.goodput import prepare_model
from bench.gpu.profile_step import cuda_kernel_stats
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig

ONE = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
REPEATS = 5


def cases(vocab: int, seed: int) -> dict[str, Callable[[Engine], None]]:
    """Each case: one call that runs one prompt batch to its first token. Every call draws new
    tokens (a seed per variant), so only the follow-up case meets the prefix cache."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    history = prompt(2000)

    def follow_up(eng: Engine) -> None:  # 2,000 cached tokens, 200 new ones
        eng.generate([history + prompt(200)], ONE)

    out: dict[str, Callable[[Engine], None]] = {
        f"prompt_{n}": (lambda eng, n=n: eng.generate([prompt(n)], ONE)) for n in (32, 256, 1024, 2048)
    }
    out["follow_up_200_over_2000"] = follow_up
    out["four_prompts_of_64"] = lambda eng: eng.generate([prompt(64) for _ in range(4)], ONE)
    out["history_2000"] = lambda eng: eng.generate([history], ONE)  # puts the history in the cache
    return out


def measure(eng: Engine, fn: Callable[[Engine], None]) -> dict[str, Any]:
    walls = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn(eng)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(eng)
        torch.cuda.synchronize()
    per_name, busy_us, span_us = cuda_kernel_stats(prof, 1)
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:12]
    pr = cProfile.Profile()
    pr.enable()
    fn(eng)
    torch.cuda.synchronize()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(30)
    cum = io.StringIO()
    pstats.Stats(pr, stream=cum).sort_stats("cumulative").print_stats(45)
    return {
        "wall_ms": sorted(w * 1e3 for w in walls),
        "gpu_busy_ms": busy_us / 1e3,
        "gpu_span_ms": span_us / 1e3,
        "top_kernels_us": {k: round(v[0], 1) for k, v in top},
        "launches": int(sum(v[1] for v in per_name.values())),
        "cprofile_tottime": text.getvalue(),
        "cprofile_cumulative": cum.getvalue(),
    }


def eagle_algorithm(flags: list[str]) -> Any:
    """EAGLE with the default steps, bound the way a node binds it, from prepare_model's flags."""
    from spec.config import SpecConfig
    from spec.registry import bind

    return bind(SpecConfig("EAGLE", flags[flags.index("--speculative-draft-model-path") + 1]))


def trace_follow_up(eng: Engine, fn: Callable[[Engine], None], out: Path) -> dict[str, Any]:
    """The follow-up once more (its history cached by the runs before) under a CPU + CUDA profile
    with Python stacks: the trace, gzipped, and the GPU's idle gaps with what the host ran."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu.trace_gaps import gaps_of_trace

    fn(eng)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn(eng)
        torch.cuda.synchronize()
    raw = out / "follow_up_trace.json"
    prof.export_chrome_trace(str(raw))
    gaps = gaps_of_trace(json.loads(raw.read_text()))
    with raw.open("rb") as src, gzip.open(out / "follow_up_trace.json.gz", "wb") as dst:
        dst.write(src.read())
    raw.unlink()
    return gaps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--prompt-graph-tokens", type=int, default=512, help="the engine's cuda_graph_prompt_tokens")
    ap.add_argument("--eagle", action="store_true", help="EAGLE on (the goodput bench's echo head)")
    ap.add_argument("--trace", action="store_true", help="a Chrome trace of the graphed follow-up, and its gaps")
    args = ap.parse_args()
    model_dir, spec_flags = prepare_model("llama8b", None, eagle=args.eagle)
    config = EngineConfig(
        str(model_dir),
        device="cuda:0",
        attention_backend="triton",
        overlap=True,
        cuda_graph_max_bs=8,
        cuda_graph_prompt_tokens=args.prompt_graph_tokens,
        max_total_tokens=65536,
        max_running=8,
    )
    eng = Engine(config, algorithm=eagle_algorithm(spec_flags)) if spec_flags else Engine(config)
    graphs = eng.parts.runner.graphs
    assert graphs is not None and graphs.prompt_buckets is not None
    buckets = graphs.prompt_buckets
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "variants": {}}
    for seed, variant in enumerate(("eager", "graphs")):
        graphs.prompt_buckets = buckets if variant == "graphs" else None  # the same engine, both ways
        todo = cases(eng.model_config.vocab_size, seed)
        for fn in todo.values():  # compiles
            fn(eng)
        results = report["variants"].setdefault(variant, {})
        for name, fn in todo.items():
            results[name] = r = measure(eng, fn)
            print(
                f"{variant} {name}: wall {r['wall_ms'][len(r['wall_ms']) // 2]:.1f} ms, GPU busy "
                f"{r['gpu_busy_ms']:.1f} ms, span {r['gpu_span_ms']:.1f} ms, {r['launches']} launches",
                flush=True,
            )
    median = lambda walls: walls[len(walls) // 2]  # noqa: E731
    eager, graphed = report["variants"]["eager"], report["variants"]["graphs"]
    report["wall_ratio_graphs_vs_eager"] = {
        k: median(graphed[k]["wall_ms"]) / median(eager[k]["wall_ms"]) for k in eager
    }
    print(json.dumps(report["wall_ratio_graphs_vs_eager"], indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace:
        graphs.prompt_buckets = buckets
        # the graphs variant's cases: their history is in the prefix cache
        report["gaps"] = trace_follow_up(eng, todo["follow_up_200_over_2000"], args.out)
    (args.out / "profile_prompt.json").write_text(json.dumps(report, indent=1))
    print(
        "== graphs follow_up_200_over_2000 (tottime)\n" + graphed["follow_up_200_over_2000"]["cprofile_tottime"][:6000]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
