"""CPU benchmark of speculative decoding (EAGLE chain/tree, EAGLE-3, n-gram) against plain decoding.

Run: `python -m bench.spec_cpu [--quick] [--threads N] [--out PATH]`. One tiny random target
(bench.engine_cpu's default shape) and untrained draft heads written by `write_tiny_eagle_head`:
`repeat` heads predict what the target predicted one position earlier (right inside loops),
`random` heads predict nothing. So this measures the machinery's overhead and exactness, not the
speedup a trained head would give. Every method runs on the same prompts in the same process,
round-robin with plain decoding, and reports tokens per target forward (the mean accepted
length), acceptance rate, tok/s, speedup over plain and whether its greedy output equals plain's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import write_report
from bench.engine_cpu import DEFAULT_SHAPE, _loadavg, environment, random_prompts
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import SpecRegistryError, bind, registered_names

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "spec_cpu.json"
NEW_TOKENS, RANDOM_PROMPT_LEN = 64, 32
BATCHES = (1, 4)
FULL_REPEATS, QUICK_REPEATS = 5, 1
# Short code snippets, each repeated 3 times: a context that repeats itself is where prompt
# lookup (and a head that copies the previous prediction) can be right at all.
SNIPPETS = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "x = [1, 2, 3]\ny = sum(x)\n",
    "if n < 2:\n    return n\n",
)
# name -> (description, algorithm, head key, num_steps, topk, num draft tokens)
METHODS: dict[str, tuple[str, str, str | None, int, int, int | None]] = {
    "eagle_chain_repeat": ("EAGLE chain, 3 steps, repeat head", "EAGLE", "repeat", 3, 1, None),
    "eagle_chain_random": ("EAGLE chain, 3 steps, random head", "EAGLE", "random", 3, 1, None),
    "eagle_tree_repeat": ("EAGLE tree, 3 steps, topk 2, 5 tokens, repeat head", "EAGLE", "repeat", 3, 2, 5),
    "eagle3_chain_random": ("EAGLE-3 chain, 3 steps, random head, half vocab", "EAGLE3", "eagle3", 3, 1, None),
    "ngram": ("NGRAM chain, 3 steps, n in 1..4", "NGRAM", None, 3, 1, None),
}


def write_heads(tmp: Path, target: Path, vocab: int) -> dict[str, Path]:
    return {
        "repeat": write_tiny_eagle_head(tmp / "eagle-repeat", target, "eagle", mode="repeat"),
        "random": write_tiny_eagle_head(tmp / "eagle-random", target, "eagle", mode="random"),
        "eagle3": write_tiny_eagle_head(
            tmp / "eagle3-random", target, "eagle3", mode="random", draft_vocab_size=vocab // 2
        ),
    }


def build_engines(target: Path, heads: dict[str, Path]) -> tuple[dict[str, Engine], list[str]]:
    """Plain first, then every method whose algorithm is registered; returns (engines, skipped)."""
    config = EngineConfig(str(target), dtype="float32", seed=0)
    engines = {"plain": Engine(config)}
    skipped = []
    known = set(registered_names())
    for name, (_, algo, head, steps, topk, ntok) in METHODS.items():
        if algo not in known:  # e.g. the n-gram plugin not installed: report it, don't fail
            skipped.append(name)
            continue
        cfg = SpecConfig(algo, str(heads[head]) if head else None, steps, topk, ntok)
        engines[name] = Engine(config, algorithm=bind(cfg))
    return engines, skipped


def prompt_sets(engine: Engine, vocab: int) -> dict[str, list[list[int]]]:
    """The largest batch of each set; a batch of b takes the first b prompts."""
    n = max(BATCHES)
    rand = random_prompts(n, RANDOM_PROMPT_LEN, vocab, seed=7)
    if engine.tokenizer is None:
        raise RuntimeError("the tiny target has no tokenizer; repetitive prompts need one")
    rep = [engine.tokenizer.encode(SNIPPETS[i % len(SNIPPETS)] * 3) for i in range(n)]
    return {"random": rand, "repetitive": rep}


def _stats_snapshot(engine: Engine) -> tuple[int, int, dict[int, int]] | None:
    st = getattr(engine.executor, "stats", None)
    if st is None:
        return None
    return st.verifies, st.accepted_drafts, dict(st.accept_len_hist)


def bench_workload(engines: dict[str, Engine], prompts: list[list[int]], repeats: int) -> dict[str, Any]:
    """Round-robin over the engines so that load from a neighbour hits every method alike."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    before = {name: (_stats_snapshot(e), e.scheduler.stats["steps"]) for name, e in engines.items()}
    for rnd in range(repeats + 1):  # round 0 is the untimed warm-up
        for name, eng in engines.items():
            start = time.perf_counter()
            outs = eng.generate(prompts, params)
            elapsed = time.perf_counter() - start
            ids = [o.output_ids for o in outs]
            assert all(len(i) == NEW_TOKENS for i in ids), "ignore_eos run ended early"
            if rnd == 0:
                outputs[name] = ids
            else:
                times[name].append(elapsed)
                assert ids == outputs[name], f"{name}: greedy output changed between runs"
    tokens = len(prompts) * NEW_TOKENS
    plain_sec = statistics.median(times["plain"])
    res: dict[str, Any] = {}
    for name, eng in engines.items():
        sec = statistics.median(times[name])
        row: dict[str, Any] = {
            "tokens": tokens,
            "seconds": sec,
            "tok_s": tokens / sec,
            "speedup": plain_sec / sec,
            "min_seconds": min(times[name]),
            "max_over_min": max(times[name]) / min(times[name]),
            "steps_per_run": (eng.scheduler.stats["steps"] - before[name][1]) / (repeats + 1),
            "greedy_equals_plain": outputs[name] == outputs["plain"],
            "tokens_per_forward": 1.0,
            "acceptance_rate": None,
        }
        snap0, snap1 = before[name][0], _stats_snapshot(eng)
        if snap0 is not None and snap1 is not None:
            verifies, accepted = snap1[0] - snap0[0], snap1[1] - snap0[1]
            max_drafts = eng.executor.stats.max_drafts
            hist = {k: v - snap0[2].get(k, 0) for k, v in sorted(snap1[2].items())}
            # Same definitions as SpecStats, restricted to this workload's runs.
            row.update(
                verifies=verifies,
                accept_len_hist={k: v for k, v in hist.items() if v},
                tokens_per_forward=1.0 + accepted / verifies if verifies else 0.0,
                acceptance_rate=accepted / (verifies * max_drafts) if verifies else 0.0,
            )
        res[name] = row
    return res


def run(quick: bool = False, shape: dict[str, Any] | None = None, threads: int | None = 1) -> dict[str, Any]:
    """Run every workload and return the results (nothing printed or written)."""
    repeats = QUICK_REPEATS if quick else FULL_REPEATS
    shape = dict(DEFAULT_SHAPE if shape is None else shape)
    old_threads = torch.get_num_threads()
    if threads:
        # One thread by default: on a shared 2-core host, two OpenMP threads spin-waiting on
        # each other slow these small-op steps 10-100x whenever a neighbour is busy.
        torch.set_num_threads(threads)
    try:
        env = environment()
        with tempfile.TemporaryDirectory(prefix="pdserve-spec-bench-") as tmp:
            target = write_tiny_model(Path(tmp) / "target", "LlamaForCausalLM", seed=0, **shape)
            vocab_full = json.loads((target / "config.json").read_text())["vocab_size"]
            heads = write_heads(Path(tmp), target, vocab_full)
            engines, skipped = build_engines(target, heads)
            plain = engines["plain"]
            vocab = plain.tokenizer.vocab_size if plain.tokenizer else vocab_full
            n_params = sum(p.numel() for p in plain.parts.runner.model.parameters())
            results = {}
            for set_name, prompts in prompt_sets(plain, vocab).items():
                for b in BATCHES:
                    results[f"{set_name}_b{b}"] = dict(
                        prompt_lens=[len(p) for p in prompts[:b]], methods=bench_workload(engines, prompts[:b], repeats)
                    )
    finally:
        torch.set_num_threads(old_threads)
    env = dict(env, loadavg_after=_loadavg())
    return {
        "benchmark": "spec_cpu",
        "quick": quick,
        "repeats": repeats,
        "shape": shape,
        "params": n_params,
        "new_tokens": NEW_TOKENS,
        "env": env,
        "methods": {"plain": "plain decoding", **{k: v[0] for k, v in METHODS.items()}},
        "skipped": skipped,
        "results": results,
    }


def format_table(report: dict[str, Any]) -> str:
    rows = [
        "| prompts | batch | method | tokens/forward | acceptance | tok/s | speedup | greedy = plain |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for key, work in report["results"].items():
        set_name, batch = key.rsplit("_b", 1)
        for name, r in work["methods"].items():
            acc = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.0f}%"
            rows.append(
                f"| {set_name} | {batch} | {report['methods'][name]} | "
                f"{r['tokens_per_forward']:.2f} | {acc} | {r['tok_s']:,.0f} | "
                f"{r['speedup']:.2f}x | {r['greedy_equals_plain']} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_cpu", description=__doc__)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} timed repetition(s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file")
    args = ap.parse_args(argv)
    try:
        report = run(quick=args.quick, threads=args.threads)
    except SpecRegistryError as e:
        raise SystemExit(f"error: {e}") from None
    env = report["env"]
    print(
        f"CPU: {env['cpu']} ({env['cores']} cores, torch {env['torch']}, "
        f"{env['torch_threads']} threads); target: tiny Llama {report['shape']}, "
        f"{report['params'] / 1e6:.2f}M params; {report['new_tokens']} new tokens, greedy; "
        f"repeats: {report['repeats']} (median); load average before/after: "
        f"{env['loadavg_before']} / {env['loadavg_after']}\n"
    )
    print(format_table(report))
    if report["skipped"]:
        print(f"\nskipped (algorithm not registered): {', '.join(report['skipped'])}")
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
