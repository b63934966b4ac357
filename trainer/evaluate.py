"""Acceptance of the trained pair measured with the project's own engine, on held-out prompts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from spec.config import SpecConfig
from spec.registry import bind


def heldout_prompts(tok: Tokenizer, texts: Sequence[str], n: int, prompt_tokens: int) -> list[list[int]]:
    """`n` prompts: prefixes of held-out files (round robin; later rounds cut deeper into a file)."""
    encoded = [tok.encode(t).ids for t in texts if t.strip()]
    if not encoded:
        raise ValueError("no held-out text to build prompts from")
    prompts = []
    for i in range(n):
        ids = encoded[i % len(encoded)]
        cut = prompt_tokens * (1 + i // len(encoded))
        prompts.append(ids[: max(2, min(cut, len(ids) - 1))])
    return prompts


def measure_acceptance(
    target_dir: Path,
    head_dir: Path,
    prompts: list[list[int]],
    *,
    new_tokens: int,
    num_steps: int = 4,
    device: str = "cpu",
    dtype: str | None = None,
) -> dict[str, Any]:
    """Greedy, chain of `num_steps` drafts: mean accepted length per verify (drafts + bonus),
    and whether speculative output equals plain output (it must, at temperature 0)."""
    config = EngineConfig(str(target_dir), dtype=dtype, device=device, seed=0)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    plain = Engine(config).generate(prompts, params)
    plain_s = time.perf_counter() - start
    spec_cfg = SpecConfig("EAGLE", str(head_dir), num_steps=num_steps, eagle_topk=1)
    eng = Engine(config, algorithm=bind(spec_cfg))
    start = time.perf_counter()
    outs = eng.generate(prompts, params)
    spec_s = time.perf_counter() - start
    stats = eng.executor.stats
    return {
        "prompts": len(prompts),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "new_tokens": new_tokens,
        "num_draft_tokens": num_steps,
        "topk": 1,
        "temperature": 0.0,
        "mean_accept_len": stats.mean_accept_len,
        "acceptance_rate": stats.acceptance_rate,
        "verifies": stats.verifies,
        "accept_len_hist": dict(sorted(stats.accept_len_hist.items())),
        "greedy_equals_plain": [o.output_ids for o in outs] == [o.output_ids for o in plain],
        "plain_seconds": plain_s,
        "spec_seconds": spec_s,
        "device": device,
    }
