"""The goodput benchmark's workloads: prompt and output lengths drawn from a seed, and token-id
prompts of exactly those lengths (the completions endpoint takes ids as they are: no tokenizer
rounding at the cut, no BOS added).

Three per model size. `prefill_heavy` and `decode_heavy` have fixed lengths; `chat_mix` is a
long-tailed mix like chat traffic: prompt and output lengths each log-normal (median and sigma of
the underlying normal's log), rounded and clipped to [low, high]. The tiny variants keep the same
shapes at lengths a 512-position CPU model and a two-core test can run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any, Callable

from loadgen.dataset import BenchRequest

FIRST_ID = 16  # prompt ids are drawn from [FIRST_ID, vocab): above the special tokens (ids 0-5 here)


@dataclass(frozen=True)
class Lengths:
    """Token counts: `median` exactly when sigma is 0, else log-normal around it, clipped."""

    median: int
    sigma: float = 0.0
    low: int = 1
    high: int = 1 << 20

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.median <= self.high or self.sigma < 0:
            raise ValueError(f"need 1 <= low <= median <= high and sigma >= 0: {self}")

    def draw(self, rng: random.Random) -> int:
        if self.sigma == 0:
            return self.median
        return min(self.high, max(self.low, round(math.exp(rng.gauss(math.log(self.median), self.sigma)))))

    @property
    def most(self) -> int:
        return self.median if self.sigma == 0 else self.high

    def describe(self) -> dict[str, Any]:
        if self.sigma == 0:
            return {"fixed": self.median}
        return {"lognormal_median": self.median, "sigma": self.sigma, "clip": [self.low, self.high]}


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: Lengths
    output: Lengths

    def describe(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt.describe(), "output_tokens": self.output.describe()}


WORKLOADS = {
    "llama8b": (
        Workload("prefill_heavy", Lengths(2048), Lengths(150)),
        Workload("decode_heavy", Lengths(1024), Lengths(256)),
        Workload("chat_mix", Lengths(384, 1.0, 16, 4096), Lengths(128, 0.7, 8, 512)),
    ),
    "tiny": (
        Workload("prefill_heavy", Lengths(96), Lengths(6)),
        Workload("decode_heavy", Lengths(48), Lengths(12)),
        Workload("chat_mix", Lengths(24, 0.8, 4, 128), Lengths(6, 0.5, 2, 16)),
    ),
}


def make_requests(workload: Workload, n: int, seed: int, vocab: int) -> list[BenchRequest]:
    """`n` requests, the same for the same (workload, seed): lengths first, then each prompt's ids
    uniform in [FIRST_ID, vocab) (distinct prompts: nothing for a prefix cache to reuse)."""
    if vocab <= FIRST_ID:
        raise ValueError(f"a vocabulary of {vocab} tokens leaves no ids at or above {FIRST_ID}")
    rng = random.Random(f"{workload.name}:{seed}")  # a str seed is hashed the same in every process
    lengths = [(workload.prompt.draw(rng), workload.output.draw(rng)) for _ in range(n)]
    return [
        BenchRequest(i, [rng.randrange(FIRST_ID, vocab) for _ in range(p)], p, o) for i, (p, o) in enumerate(lengths)
    ]


def fresh_prompts(requests: list[BenchRequest], salt: str, vocab: int) -> list[BenchRequest]:
    """The same lengths and limits with new prompt ids drawn from `salt`: every point (and the
    warm-up) sends prompts that no earlier one sent, so the nodes' prefix caches, on by default,
    find nothing to reuse and each point costs what its lengths say."""
    rng = random.Random(f"fresh:{salt}")
    return [replace(r, prompt=[rng.randrange(FIRST_ID, vocab) for _ in range(r.input_len)]) for r in requests]


def with_time_limits(requests: list[BenchRequest], limit_s: Callable[[int], float]) -> list[BenchRequest]:
    """Each request with its own whole-time limit, `limit_s(output_len)`."""
    return [replace(r, timeout_s=limit_s(r.output_len)) for r in requests]


def length_stats(requests: list[BenchRequest]) -> dict[str, float]:
    """Mean and extremes of the drawn lengths (what a run actually sent), for the report."""
    ins, outs = [r.input_len for r in requests], [r.output_len for r in requests]
    return {
        "prompt_mean": sum(ins) / len(ins),
        "prompt_min": min(ins),
        "prompt_max": max(ins),
        "output_mean": sum(outs) / len(outs),
        "output_min": min(outs),
        "output_max": max(outs),
    }
