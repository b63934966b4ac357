"""CPU micro-benchmark of the in-process Engine on a tiny random Llama, with HF generate as reference.

Run: `python -m bench.engine_cpu [--quick] [--out PATH]`. Measures prefill throughput, decode
throughput at batch 1 and 16 (with ms per scheduler step), and our batch-1 greedy decode against
transformers' `generate` on the same weights and prompt, in the same process.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.common import write_report
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_model import write_tiny_model

# Still tiny (3.2M params, 2.9M outside the embeddings) but big enough that matmuls are not free.
DEFAULT_SHAPE: dict[str, Any] = dict(
    hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688, max_position_embeddings=2048
)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "engine_cpu.json"

PREFILL_BATCH, PREFILL_LEN = 8, 256
DECODE_PROMPT_LEN, DECODE_NEW = 32, 64
DECODE_BATCHES = (1, 16)
FULL_REPEATS, QUICK_REPEATS = 10, 1  # --quick: 10x fewer timed repetitions, same workloads
FIRST_ID = 5  # ids 0..4 are the chat specials (BOS/EOS/...): keep them out of random prompts


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(n)]


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds per call, after one untimed warm-up call (allocator, kernels, page tables)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _spread(times: list[float]) -> dict[str, float]:
    # Recorded so a reader can tell a clean run from one disturbed by other load on the host.
    return {"min_seconds": min(times), "max_over_min": max(times) / min(times)}


def bench_prefill(engine: Engine, vocab: int, repeats: int) -> dict[str, Any]:
    prompts = random_prompts(PREFILL_BATCH, PREFILL_LEN, vocab, seed=1)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    times = _timed(lambda: engine.generate(prompts, params), repeats)
    sec = statistics.median(times)
    tokens = PREFILL_BATCH * PREFILL_LEN
    return {
        "batch": PREFILL_BATCH,
        "prompt_len": PREFILL_LEN,
        "tokens": tokens,
        "seconds": sec,
        "tok_s": tokens / sec,
        **_spread(times),
    }


def bench_decode(engine: Engine, vocab: int, batch: int, repeats: int) -> dict[str, Any]:
    prompts = random_prompts(batch, DECODE_PROMPT_LEN, vocab, seed=2 + batch)
    params = SamplingParams(max_new_tokens=DECODE_NEW, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    times, steps = [], []
    for _ in range(repeats):
        steps0 = engine.scheduler.stats["steps"]
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        times.append(time.perf_counter() - start)
        steps.append(engine.scheduler.stats["steps"] - steps0)
        assert all(len(o.output_ids) == DECODE_NEW for o in outs), "ignore_eos run ended early"
    i = times.index(statistics.median_low(times))  # a real run, so its step count matches
    sec, n_steps = times[i], steps[i]
    tokens = batch * DECODE_NEW
    # Steps include the one prefill step that samples the first token (same as HF's first call).
    return {
        "batch": batch,
        "prompt_len": DECODE_PROMPT_LEN,
        "new_tokens": DECODE_NEW,
        "tokens": tokens,
        "seconds": sec,
        "tok_s": tokens / sec,
        "steps": n_steps,
        "ms_per_step": 1000.0 * sec / n_steps,
        **_spread(times),
    }


def bench_hf(model_dir: Path, engine: Engine, vocab: int, repeats: int) -> dict[str, Any]:
    """transformers' greedy generate vs ours, batch 1, same weights and prompt.

    The two are timed in alternation so that a noisy neighbour on a shared machine slows both
    sides of the ratio alike instead of whichever happened to run during the noise.
    """
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = random_prompts(1, DECODE_PROMPT_LEN, vocab, seed=2 + 1)[0]
    ids = torch.tensor([prompt])
    kwargs = dict(
        max_new_tokens=DECODE_NEW,
        min_new_tokens=DECODE_NEW,  # min: ignore EOS
        do_sample=False,
        use_cache=True,
        attention_mask=torch.ones_like(ids),
        pad_token_id=hf.generation_config.eos_token_id,
    )
    params = SamplingParams(max_new_tokens=DECODE_NEW, temperature=0.0, ignore_eos=True)

    def run_hf() -> list[int]:
        with torch.inference_mode():
            return hf.generate(ids, **kwargs)[0, len(prompt) :].tolist()

    def run_ours() -> list[int]:
        return engine.generate([prompt], params)[0].output_ids

    hf_ids, ours = run_hf(), run_ours()  # warm-up, and the tokens to compare
    hf_times, our_times = [], []
    for _ in range(repeats):
        hf_times += _timed_once(run_hf)
        our_times += _timed_once(run_ours)
    hf_sec, our_sec = statistics.median(hf_times), statistics.median(our_times)
    # Greedy on random weights can flip on near-ties, so a mismatch is reported, not fatal.
    same = next((i for i, (a, b) in enumerate(zip(ours, hf_ids)) if a != b), len(hf_ids))
    return {
        "batch": 1,
        "tokens": DECODE_NEW,
        "seconds": hf_sec,
        "tok_s": DECODE_NEW / hf_sec,
        "ours_seconds": our_sec,
        "ours_tok_s": DECODE_NEW / our_sec,
        "ratio": hf_sec / our_sec,
        "greedy_tokens_matching": same,
        "transformers": transformers.__version__,
    }


def _timed_once(fn: Callable[[], Any]) -> list[float]:
    start = time.perf_counter()
    fn()
    return [time.perf_counter() - start]


def run(quick: bool = False, shape: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every measurement and return the results (nothing printed or written)."""
    repeats = QUICK_REPEATS if quick else FULL_REPEATS
    shape = dict(DEFAULT_SHAPE if shape is None else shape)
    env = environment()
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        model_dir = write_tiny_model(Path(tmp) / "llama", "LlamaForCausalLM", seed=0, **shape)
        engine = Engine(EngineConfig(str(model_dir), dtype="float32", seed=0))
        # Random prompts stay inside the tokenizer's ids (the embedding may be padded beyond).
        vocab = engine.tokenizer.vocab_size if engine.tokenizer else engine.model_config.vocab_size
        n_params = sum(p.numel() for p in engine.parts.runner.model.parameters())
        results: dict[str, Any] = {"prefill": bench_prefill(engine, vocab, repeats)}
        for b in DECODE_BATCHES:
            results[f"decode_b{b}"] = bench_decode(engine, vocab, b, repeats)
        results["hf_b1"] = bench_hf(model_dir, engine, vocab, repeats)
    results["ours_over_hf_b1"] = results["hf_b1"]["ratio"]
    env = dict(env, loadavg_after=_loadavg())
    return {
        "benchmark": "engine_cpu",
        "quick": quick,
        "repeats": repeats,
        "shape": shape,
        "params": n_params,
        "env": env,
        "results": results,
    }


def environment() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": _nproc(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "loadavg_before": _loadavg(),
    }


def _loadavg() -> list[float]:
    # With 2 cores and 2 OpenMP threads, one busy neighbour process slows small-op workloads
    # by 10x or more (threads spin at barriers), so the load is part of the result.
    import os

    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _nproc() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def format_table(report: dict[str, Any]) -> str:
    """The results as a markdown table (one row per measurement)."""
    r = report["results"]
    p, hf = r["prefill"], r["hf_b1"]
    rows = [
        "| measurement | batch | tokens | seconds | tok/s | ms/step |",
        "|---|---:|---:|---:|---:|---:|",
        f"| prefill ({p['batch']} x {p['prompt_len']} tokens, 1 new) | {p['batch']} | "
        f"{p['tokens']} | {p['seconds']:.4f} | {p['tok_s']:,.0f} | - |",
    ]
    for b in DECODE_BATCHES:
        d = r[f"decode_b{b}"]
        rows.append(
            f"| decode ({d['prompt_len']}-token prompts, {d['new_tokens']} new, greedy) | "
            f"{b} | {d['tokens']} | {d['seconds']:.4f} | {d['tok_s']:,.0f} | "
            f"{d['ms_per_step']:.2f} |"
        )
    rows.append(
        f"| ours, batch-1 decode, timed alternating with HF | 1 | {hf['tokens']} "
        f"| {hf['ours_seconds']:.4f} | {hf['ours_tok_s']:,.0f} | - |"
    )
    rows.append(
        f"| HF transformers generate (same prompt, greedy, KV cache) | 1 | {hf['tokens']} "
        f"| {hf['seconds']:.4f} | {hf['tok_s']:,.0f} | - |"
    )
    rows.append(f"| **ours / HF, batch-1 decode** | 1 | | | **{r['ours_over_hf_b1']:.2f}x** | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_cpu", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="10x fewer timed repetitions")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file")
    args = ap.parse_args(argv)
    report = run(quick=args.quick)
    env = report["env"]
    print(
        f"CPU: {env['cpu']} ({env['cores']} cores, torch {env['torch']}, "
        f"{env['torch_threads']} threads); model: tiny Llama {report['shape']}, "
        f"{report['params'] / 1e6:.2f}M params; repeats: {report['repeats']} (median); "
        f"load average before/after: {env['loadavg_before']} / {env['loadavg_after']}\n"
    )
    print(format_table(report))
    hf = report["results"]["hf_b1"]
    print(f"\ngreedy tokens equal to HF before the first difference: {hf['greedy_tokens_matching']}/{DECODE_NEW}")
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
