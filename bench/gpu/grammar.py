"""Grammar-constrained decoding on a GPU: compile time of tool schemas, what constraints cost a
decode step at batch 64, and EAGLE's speedup under a JSON schema against its unconstrained one.

Model: Llama-3.1-8B's shape with the built-in tokenizer's 4,096-token vocabulary, random bf16
weights with widened margins, in memory; the built-in tokenizer lies beside it, so grammars
compile against the model's vocabulary. Constrained requests ask for a JSON object whose one
string field has at least 2,000 characters: the grammar forces `{"notes": "` (jump-forward
drafts) and then masks every step, and no request ends before its NEW_TOKENS tokens.

* compile: `--compiles` distinct tool schemas (the router's named-tool_choice shape, renamed each
  time, so no cache helps) compiled cold by the node's backend; p50 and p99 (goal: p99 <= 10 ms).
* mask cost: plain decoding of 64 requests, constrained against unconstrained, decode phase only;
  the share of the constrained step that the constraint adds (goal: <= 5%). Constrained batches
  keep overlap (the batch in flight is collected inside the next launch, once its forward is
  enqueued) but not the whole-step graph, so this is the constraint's whole cost per step, masks
  included.
* EAGLE: the synthetic EAGLE-3 head of bench/gpu/spec_speedup.py (every draft forward runs, then
  an oracle makes a draft right with probability p, from a plain run of the same requests under
  the same constraint), fixed 3 steps, at batch 1 and 8 (constrained chains run as two graphs
  around the host's grammar walk, spec/constrained_graphs.py): speedup over plain decoding with the
  constraint and without, and their ratio (goal: >= 0.9). Output must equal plain decoding. At
  batch 1 one more pass of each runs under the profiler: the GPU's busy milliseconds per
  iteration and its idle share, which tell a host-bound constrained iteration from heavier device work.

  python -m bench.gpu.grammar OUT          # GPU: writes OUT/grammar_<gpu>.json
  python -m bench.gpu.grammar OUT --tiny   # the same code on a tiny shape on the CPU
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

from bench.common import short_name, write_report
from bench.gpu.engine_perf import busy_fraction
from bench.gpu.goodput_model import llama8b_config
from bench.gpu.spec_speedup import (
    NEW_TOKENS,
    engine_for,
    prompts_for,
    release_memory,
    synthetic_setup,
    timed_decode,
)
from common.sampling import Constraint
from engine.core import SamplingParams
from engine.grammar.compiler import make_backend

GOALS = {"compile_p99_ms_max": 10.0, "mask_share_of_step_max": 0.05, "eagle_speedup_ratio_min": 0.9}
LONG_NOTES = {
    "type": "object",
    "properties": {"notes": {"type": "string", "minLength": 2000}},
    "required": ["notes"],
    "additionalProperties": False,
}
P, STEPS = 0.9, 3
TINY_SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY_SHAPE |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "float32"}


def tool_schema(i: int) -> str:
    """An OpenAI tool's parameters, as a named tool_choice constrains them; renamed by `i`."""
    return json.dumps(
        {
            "type": "object",
            "properties": {
                f"city_{i}": {"type": "string", "description": "City and country"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "hourly": {"type": "boolean"},
                "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            },
            "required": [f"city_{i}", "unit"],
            "additionalProperties": False,
        }
    )


def compile_times(model_dir: Path, vocab: int, eos: list[int], n: int) -> dict[str, Any]:
    backend = make_backend("llguidance", model_dir, vocab, eos)
    backend.compile("json_schema", tool_schema(-1))  # the tokenizer's one-time set-up is not a compile
    ms = []
    for i in range(n):
        t0 = time.perf_counter()
        backend.compile("json_schema", tool_schema(i))
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return {"backend": "llguidance", "compiles": n, "p50_ms": statistics.median(ms), "p99_ms": ms[-1 - n // 100]}


def params(constrained: bool) -> SamplingParams:
    notes = Constraint("json_schema", json.dumps(LONG_NOTES)) if constrained else None
    return SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, constraint=notes)


def best_pass(eng: Any, prompts: list[list[int]], constrained: bool, repeats: int) -> dict[str, Any]:
    return max((timed_decode(eng, prompts, params(constrained)) for _ in range(repeats)), key=lambda r: r["tok_s"])


def device_time(eng: Any, prompts: list[list[int]], constrained: bool) -> dict[str, float]:
    """One more pass under the profiler (device activity only): the GPU's busy milliseconds per
    iteration and its idle share of the pass, which tell host-bound iterations from heavier device
    work. Empty off GPUs."""
    if not torch.cuda.is_available():
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = timed_decode(eng, prompts, params(constrained))
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        busy, span = busy_fraction(trace)
    iterations = (NEW_TOKENS - 1) / r["accept_len"]  # the decode phase of each request (the prefill gave one)
    return {"gpu_busy_ms_per_iteration": busy * 1e3 / iterations, "gpu_idle_fraction": 1 - busy / span if span else 0.0}


def run(out: Path, tiny: bool, compiles: int, repeats: int) -> dict[str, Any]:
    raw = llama8b_config(**(TINY_SHAPE if tiny else {}))
    cfg, model, head, _, picker = synthetic_setup("grammar", raw=raw, tokenizer=True)
    model_dir = str(head.parent)
    report: dict[str, Any] = {"compile": compile_times(head.parent, cfg.vocab_size, list(cfg.eos_token_ids), compiles)}
    batches, mask_batch = ((1, 2), 4) if tiny else ((1, 8), 64)
    plain_eng = engine_for(model, cfg, None, None, model_dir=model_dir)
    plain: dict[tuple[int, bool], dict[str, Any]] = {}
    tables: dict[bool, dict[tuple[int, ...], list[int]]] = {False: {}, True: {}}
    for bs in sorted({*batches, mask_batch}):
        ps = prompts_for(bs, cfg.vocab_size)
        for constrained in (False, True):
            r = plain[(bs, constrained)] = best_pass(plain_eng, ps, constrained, repeats)
            tables[constrained].update({tuple(p): p + o for p, o in zip(ps, r["outputs"])})
            print(f"plain bs {bs} constrained={constrained}: {r['tok_s']:.0f} tok/s, step {r['step_ms']:.2f} ms")
    free, held = plain[(mask_batch, False)], plain[(mask_batch, True)]
    report["mask_cost"] = {
        "batch": mask_batch,
        "plain_step_ms": free["step_ms"],
        "constrained_step_ms": held["step_ms"],
        "share_of_step": 1 - free["step_ms"] / held["step_ms"],
    }
    del plain_eng
    release_memory()
    spec_eng = engine_for(model, cfg, head, STEPS, model_dir=model_dir)
    picker.set_p(P)
    report["eagle"] = []
    for bs in batches:
        ps = prompts_for(bs, cfg.vocab_size)
        point: dict[str, Any] = {"batch": bs, "p": P, "steps": STEPS}
        for constrained, label in ((False, "free"), (True, "json")):
            picker.sequences = tables[constrained]
            r = best_pass(spec_eng, ps, constrained, repeats)
            base = plain[(bs, constrained)]
            exact = sum(a == b for a, b in zip(r["outputs"], base["outputs"])) / bs
            point[label] = {
                "plain_tok_s": base["tok_s"],
                "eagle_tok_s": r["tok_s"],
                "speedup": r["tok_s"] / base["tok_s"],
                "accept_len": r["accept_len"],
                "exact": exact,
                **(device_time(spec_eng, ps, constrained) if bs == batches[0] else {}),
            }
        point["speedup_ratio"] = point["json"]["speedup"] / point["free"]["speedup"]
        report["eagle"].append(point)
        print(f"eagle bs {bs}: free {point['free']['speedup']:.2f}x, json {point['json']['speedup']:.2f}x")
    del spec_eng
    release_memory()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report |= {"device": device, "model": "tiny" if tiny else "Llama-3.1-8B shape, vocab 4096", "goals": GOALS}
    report["command"] = "python -m bench.gpu.grammar OUT" + (" --tiny" if tiny else "")
    gpu = short_name(device)
    write_report(out / f"grammar_{gpu}.json", report)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU: the code path only")
    ap.add_argument("--compiles", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2, help="passes per figure, the best kept")
    args = ap.parse_args()
    report = run(args.out, args.tiny, args.compiles, args.repeats)
    print(json.dumps({k: report[k] for k in ("compile", "mask_cost", "eagle")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
