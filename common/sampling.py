"""The sampling-parameter schema router and nodes share, and its validation (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class InvalidRequest(ValueError):
    """A request a node refuses before doing any work; the message names the bad field."""


# The grammar kinds a request may constrain its output with: the scheduler API's `constraint`
# oneof (SamplingParams.regex / json_schema / ebnf_grammar / structural_tag), by our names.
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
PROTO_CONSTRAINT_FIELDS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf_grammar",
    "structural_tag": "structural_tag",
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """A grammar the output must follow: `kind` one of CONSTRAINT_KINDS, `spec` its source text
    (a JSON schema as JSON text, a regex, a Lark/EBNF grammar, or a structural tag as JSON text)."""

    kind: str
    spec: str


MAX_STREAM_INTERVAL = 1024  # tokens; a request's own stream_interval above this is refused


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding controls (the scheduler API's SamplingParams); `check` validates them."""

    max_new_tokens: int = 16
    # EOS and stop token ids are masked, and stop strings ignored, until this many tokens exist
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True  # in the text stop strings are matched against
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as OpenAI's
    constraint: Constraint | None = None  # grammar-constrained output (None: free text)
    # tokens a streamed message gathers after the first, at least (the node's own setting may ask
    # for more); 0: the node's alone. The router asks for more when its relay runs past its budget.
    stream_interval: int = 0

    def check(self) -> None:
        """Raise InvalidRequest naming the first field out of range."""
        _check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1", self.max_new_tokens)
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be in [0, max_new_tokens={self.max_new_tokens}]",
            self.min_new_tokens,
        )
        _check(
            _finite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            "must be a finite number >= 0",
            self.temperature,
        )
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (off) or >= 0", self.top_k)
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(
            _finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )
        _check(
            _finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
            self.presence_penalty,
        )
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be > 0",
            self.repetition_penalty,
        )
        _check(0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]", self.top_logprobs)
        _check(
            0 <= self.stream_interval <= MAX_STREAM_INTERVAL,
            "stream_interval",
            f"must be in [0, {MAX_STREAM_INTERVAL}]",
            self.stream_interval,
        )
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2^63)", self.seed)
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0", self.stop_token_ids)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop)
        _check(
            all(t >= 0 and _finite(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
            "logit_bias",
            "must map token ids >= 0 to biases in [-100, 100]",
            self.logit_bias,
        )
        c = self.constraint
        _check(c is None or c.kind in CONSTRAINT_KINDS, "constraint", f"must be one of {CONSTRAINT_KINDS}", c)
        _check(c is None or bool(c.spec), "constraint", "must have a non-empty grammar", c)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise InvalidRequest(f"{name} {rule}, got {value!r}")
