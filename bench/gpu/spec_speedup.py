"""Speculative speedup over plain decoding on Llama-shaped random-weight targets, by batch size and
accepted length: fixed step counts 1/3/5/7 and adaptive steps, against the ideal.

The draft is a random EAGLE-3 head (draft vocabulary 32000) whose choices an oracle replaces by
the target's own next token with probability p (bench/gpu/synthetic.py): every draft forward
costs what a real one does, verification is real, and p sets the accepted length. For each model
shape and batch size: plain decode throughput, then per p and per configuration the decode
throughput (the best of two passes), the realized accepted length, and whether the output of
every pass equals plain decoding. The ideal speedup is accepted length x plain step time /
iteration time. Adaptive steps start each point from a fresh controller; they are timed on the
second and third passes of the same traffic, the first pass is reported too
(`adaptive_cold_tok_s`), and the fifth and sixth (`adaptive_settled_tok_s`: by then a controller
that keeps failing upshift probes has backed off further). At p = 0 a configuration pinned at 0
steps (`zero_steps_tok_s`: the target alone, the draft only catching up) is what adaptive steps
can reach at best there. At p = 0, where speculation can at best tie plain decoding, the 0-step and
adaptive passes also alternate with passes of the plain engine, kept alive for that
(`paired_plain_tok_s`: the best of the plain passes in the same minutes), so a drift of the
host's speed between the start of the sweep and these passes does not decide the comparison.

Run on the GPU machine: `python -m bench.gpu.spec_speedup llama-8b OUT` (and llama-1b; `batches=1,8`
limits the batch sizes); writes
OUT/spec_speedup_<gpu>_<model>.json ({"device", "points": [...]}, the layout of
bench/results/spec_speedup_<gpu>.json) and a plot.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import spec.registry as registry
from bench.common import short_name, write_report
from bench.gpu.engine_perf import make_engine
from bench.gpu.llama8b import LLAMA_8B, build_engine_model, shape_config
from bench.gpu.synthetic import PICKER, OraclePicker, SyntheticEagle3, widen_margins
from engine.core import SamplingParams
from engine.engine import Engine
from fixtures.tiny_eagle import write_tiny_eagle_head
from spec.config import SpecConfig
from spec.registry import bind

LLAMA_1B = dict(
    LLAMA_8B,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# a dry run of the script's logic on a CPU (TRITON_INTERPRET=1): tiny shapes, two batch sizes
TINY = dict(
    LLAMA_8B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    torch_dtype="float32",
)
MODELS = {"llama-8b": LLAMA_8B, "llama-1b": LLAMA_1B, "tiny": TINY}
BATCHES = (1, 2, 4, 8, 16, 32, 64)
P_VALUES = (0.0, 0.7, 0.9)  # 0.9: about 3.2 tokens per verify with 3 steps (realized, reported)
FIXED = (1, 3, 5, 7)
# every batch size pinned at 0 steps (the draft only catches up): what adaptive steps cost at best
# on traffic whose drafts are never accepted (the 128 slot is never used: it only holds step 1)
ZERO_ONLY = {"1": {"candidate_steps": [0]}, "128": {"candidate_steps": [1]}}
ADAPTIVE_PASSES = 6  # adaptive: pass 1 cold, passes 2-3 reported, 5-6 settled
# Every figure is the best of REPEATS passes of the same traffic: on a small target both plain and
# speculative decoding are host-bound at batch >= 8, and the host's speed drifts between passes
# by up to 10%, more than the differences measured
REPEATS = 2
PROMPT_LEN, NEW_TOKENS = 256, 96
MAX_RUNNING = 64


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts_for(bs: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1000 + bs)
    return [torch.randint(10, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(bs)]


def timed_decode(eng: Engine, prompts: list[list[int]], params: SamplingParams | None = None) -> dict[str, Any]:
    """Prefill, then time the decode phase only (until every request ended); greedy, NEW_TOKENS
    each, unless `params` says otherwise."""
    params = params or SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = {eng.add_request(p, params): [] for p in prompts}
    first: set[str] = set()
    while len(first) < len(out):
        for d in eng.step():
            out[d.rid] += d.token_ids
            if d.token_ids:
                first.add(d.rid)
    stats = eng.executor.spec_stats()
    v0, a0 = (stats.verifies, stats.accepted_drafts) if stats else (0, 0)
    sync()
    t0, steps, tokens = time.perf_counter(), 0, 0
    while not eng.idle:
        for d in eng.step():
            out[d.rid] += d.token_ids
            tokens += len(d.token_ids)
        steps += 1
    sync()
    secs = time.perf_counter() - t0
    verifies = (stats.verifies - v0) if stats else 0
    accept = 1 + (stats.accepted_drafts - a0) / verifies if verifies else 1.0
    return {
        "outputs": [out[r] for r in out],
        "tok_s": tokens / secs,
        "step_ms": secs / max(steps, 1) * 1e3,
        "accept_len": accept,
    }


def paired_passes(
    eng: Engine, plain_eng: Engine, prompts: list[list[int]], n: int
) -> tuple[list[dict[str, Any]], float]:
    """n passes of `eng` and n of the plain engine on the same prompts, in the order plain, eng,
    eng, plain (repeated): as many of each, and a linear drift of the host's speed weighs on both
    alike. Returns (the passes of `eng`, the best plain throughput of the window)."""
    plain, passes = [], []
    for _ in range(-(-n // 2)):
        plain.append(timed_decode(plain_eng, prompts)["tok_s"])
        passes += [timed_decode(eng, prompts) for _ in range(2)]
        plain.append(timed_decode(plain_eng, prompts)["tok_s"])
    return passes, max(plain)


def engine_for(
    model: torch.nn.Module,
    cfg: Any,
    head: Path | None,
    steps: int | None,
    adaptive_config: str | None = None,
    model_dir: str | None = None,
) -> Engine:
    binding = None
    if head is not None:
        adaptive = steps is None or adaptive_config is not None
        spec = SpecConfig("SYNTHETIC", str(head), steps or 3, 1, adaptive=adaptive, adaptive_config=adaptive_config)
        binding = bind(spec)
    total = MAX_RUNNING * (PROMPT_LEN + NEW_TOKENS + 96)
    eng = make_engine(
        model,
        cfg,
        overlap=True,
        graphs=MAX_RUNNING,
        max_running=MAX_RUNNING,
        max_total_tokens=total,
        algorithm=binding,
        backend="triton" if torch.cuda.is_available() else "torch",
        cuda_graph_padded_eager=not torch.cuda.is_available(),
        **({"model_dir": model_dir} if model_dir else {}),
    )
    freeze_engine_objects()
    return eng


def fresh_controller(eng: Engine) -> None:
    """A new adaptive controller (same config, initial steps and graph sizes) for each traffic
    point: one point's history (e.g. upshift backoff after a run of rejected drafts) must not
    decide the next point's measurement."""
    states = eng.executor.states
    assert states.policy is not None
    states.policy = states.policy.restarted()


def freeze_engine_objects() -> None:
    """As a node does once its engine is built (engine/service/node.py): the engine's objects
    leave the collector's generations, so full collections stay cheap during the passes."""
    gc.collect()
    gc.freeze()


def release_memory() -> None:
    """After the caller dropped its engine: two 8B engines' graphs and KV do not fit together."""
    gc.unfreeze()  # frozen objects are never collected: the dropped engine must be
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synthetic_setup(
    name: str, raw: dict[str, Any] | None = None, tokenizer: bool = False
) -> tuple[Any, torch.nn.Module, Path, str, OraclePicker]:
    """(config, target model, synthetic head dir, pinned-at-0 adaptive config path, oracle picker)
    for a model shape (`raw`, else MODELS[name]): random weights with widened margins, registered as
    SYNTHETIC. With `tokenizer`, the built-in tokenizer lies beside the head dir's parent config
    (the shape must have its vocabulary), for grammars."""
    raw, cfg = shape_config(raw or MODELS[name])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_engine_model(cfg, dev)
    widen_margins(model)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(raw))
    if tokenizer:
        from bench.gpu.goodput_model import write_tokenizer

        write_tokenizer(tmp, PROMPT_LEN + NEW_TOKENS + 96)
    (tmp / "zero.json").write_text(json.dumps(ZERO_ONLY))
    head = write_tiny_eagle_head(
        tmp / "head",
        tmp,
        "eagle3",
        draft_vocab_size=min(32000, cfg.vocab_size // 2),
        intermediate_size=cfg.intermediate_size,
    )
    registry.register_class("SYNTHETIC", SyntheticEagle3)
    picker = PICKER["current"] = OraclePicker(MAX_RUNNING, PROMPT_LEN + NEW_TOKENS + 96, cfg.vocab_size, dev)
    return cfg, model, head, str(tmp / "zero.json"), picker


def sweep(name: str, out_dir: Path, batches: tuple[int, ...]) -> dict[str, Any]:
    cfg, model, head, zero_config, picker = synthetic_setup(name)
    dev = next(model.parameters()).device
    eng = engine_for(model, cfg, None, None)
    plain: dict[int, dict[str, Any]] = {}
    for bs in batches:
        ps = prompts_for(bs, cfg.vocab_size)
        plain[bs] = max((timed_decode(eng, ps) for _ in range(REPEATS)), key=lambda x: x["tok_s"])
        for p, o in zip(ps, plain[bs]["outputs"]):
            picker.sequences[tuple(p)] = p + o
        print(f"{name} plain bs {bs}: {plain[bs]['tok_s']:.0f} tok/s, step {plain[bs]['step_ms']:.2f} ms", flush=True)
    plain_eng = eng  # kept for the p = 0 passes that alternate with plain ones
    runs: dict[str, dict[tuple[int, float], dict[str, Any]]] = {}
    labels = [*((str(s), s, None) for s in FIXED), ("0", 1, zero_config), ("adaptive", None, None)]
    for label, steps, adaptive_config in labels:
        eng = engine_for(model, cfg, head, steps, adaptive_config)
        runs[label] = {}
        for bs in batches:
            ps = prompts_for(bs, cfg.vocab_size)
            for p in P_VALUES if label != "0" else (0.0,):
                picker.set_p(p)
                cold = settled = None
                if label == "adaptive":  # from the initial steps, then the controller's steady state
                    fresh_controller(eng)
                    cold = timed_decode(eng, ps)["tok_s"]
                paired_plain = None
                if p == 0.0 and label in ("0", "adaptive"):
                    passes, paired_plain = paired_passes(eng, plain_eng, ps, REPEATS)
                else:
                    passes = [timed_decode(eng, ps) for _ in range(REPEATS)]
                r = max(passes, key=lambda x: x["tok_s"])
                if label == "adaptive":  # the same traffic on: the upshift probes' backoff grows
                    for _ in range(ADAPTIVE_PASSES - 1 - 2 * REPEATS):
                        timed_decode(eng, ps)
                    late = [timed_decode(eng, ps) for _ in range(REPEATS)]
                    settled = max(x["tok_s"] for x in late)
                    passes += late
                r["cold_tok_s"], r["settled_tok_s"], r["paired_plain_tok_s"] = cold, settled, paired_plain
                r["exact"] = min(sum(a == b for a, b in zip(x["outputs"], plain[bs]["outputs"])) / bs for x in passes)
                r.pop("outputs")
                runs[label][(bs, p)] = r
                print(
                    f"{name} {label} bs {bs} p {p}: {r['tok_s']:.0f} tok/s ({r['tok_s'] / plain[bs]['tok_s']:.2f}x), "
                    f"accept {r['accept_len']:.2f}, exact {r['exact']:.2f}, iteration {r['step_ms']:.2f} ms"
                    + (
                        f", cold {cold:.0f} tok/s, settled {settled:.0f} tok/s ({settled / plain[bs]['tok_s']:.2f}x)"
                        if cold and settled
                        else ""
                    )
                    + (
                        f", paired plain {paired_plain:.0f} tok/s ({r['tok_s'] / paired_plain:.3f}x)"
                        if paired_plain
                        else ""
                    ),
                    flush=True,
                )
        del eng
        release_memory()
        write_report(
            out_dir / f"spec_speedup_{name}_partial.json",
            {
                "plain": {str(b): {k: v for k, v in r.items() if k != "outputs"} for b, r in plain.items()},
                "runs": {lab: {f"{b}/{p}": r for (b, p), r in rr.items()} for lab, rr in runs.items()},
            },
        )
    points = []
    for bs in batches:
        for p in P_VALUES:
            best = max(FIXED, key=lambda s: runs[str(s)][(bs, p)]["tok_s"])
            ideal = {
                s: runs[str(s)][(bs, p)]["accept_len"] * plain[bs]["step_ms"] / runs[str(s)][(bs, p)]["step_ms"]
                for s in FIXED
            }
            points.append(
                {
                    "model": name,
                    "batch": bs,
                    "p": p,
                    "accept_len": runs[str(best)][(bs, p)]["accept_len"],
                    "plain_tok_s": plain[bs]["tok_s"],
                    "plain_step_ms": plain[bs]["step_ms"],
                    "fixed_tok_s": {str(s): runs[str(s)][(bs, p)]["tok_s"] for s in FIXED},
                    "fixed_accept_len": {str(s): runs[str(s)][(bs, p)]["accept_len"] for s in FIXED},
                    "fixed_iteration_ms": {str(s): runs[str(s)][(bs, p)]["step_ms"] for s in FIXED},
                    "fixed_ideal_speedup": {str(s): v for s, v in ideal.items()},
                    "adaptive_tok_s": runs["adaptive"][(bs, p)]["tok_s"],
                    "adaptive_cold_tok_s": runs["adaptive"][(bs, p)]["cold_tok_s"],
                    "adaptive_settled_tok_s": runs["adaptive"][(bs, p)]["settled_tok_s"],
                    "zero_steps_tok_s": runs["0"][(bs, 0.0)]["tok_s"] if p == 0.0 else None,
                    "zero_steps_paired_plain_tok_s": runs["0"][(bs, 0.0)]["paired_plain_tok_s"] if p == 0.0 else None,
                    "adaptive_paired_plain_tok_s": runs["adaptive"][(bs, p)]["paired_plain_tok_s"],
                    "adaptive_iteration_ms": runs["adaptive"][(bs, p)]["step_ms"],
                    "adaptive_accept_len": runs["adaptive"][(bs, p)]["accept_len"],
                    "exact_fraction": min(r[(bs, p)]["exact"] for r in runs.values() if (bs, p) in r),
                }
            )
    del plain_eng
    release_memory()
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    gpu = short_name(device)
    report = {
        "device": device,
        "torch": torch.__version__,
        "points": points,
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "command": f"python -m bench.gpu.spec_speedup {name} OUT",
    }
    write_report(out_dir / f"spec_speedup_{gpu}_{name}.json", report)
    return report


def merge_reports(out_dir: Path, gpu: str) -> Path:
    """One `spec_speedup_<gpu>.json` with every model's points (the layout the results use)."""
    parts = [json.loads(f.read_text()) for f in sorted(out_dir.glob(f"spec_speedup_{gpu}_*.json"))]
    merged = {
        **{k: v for k, v in parts[0].items() if k != "points"},
        "points": [p for part in parts for p in part["points"]],
        "command": "python -m bench.gpu.spec_speedup "
        + " ".join(sorted({p["model"] for part in parts for p in part["points"]}))
        + " OUT",
    }
    path = out_dir / f"spec_speedup_{gpu}.json"
    write_report(path, merged)
    return path


def main() -> int:
    names = [a for a in sys.argv[1:] if a in MODELS] or list(MODELS)
    sizes = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("batches=")]
    rest = [a for a in sys.argv[1:] if a not in MODELS and not a.startswith("batches=")]
    batches = tuple(int(b) for b in sizes[0].split(",")) if sizes else None
    out = Path(rest[0]) if rest else Path("bench/results")
    gpu = ""
    for name in names:
        report = sweep(name, out, batches or (BATCHES if torch.cuda.is_available() else (1, 4)))
        gpu = short_name(report["device"])
    print("wrote", merge_reports(out, gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
