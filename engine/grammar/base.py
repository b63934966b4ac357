"""The grammar engine's interface: a compiled grammar, its per-request matcher, and a backend."""

from __future__ import annotations

import json
from typing import Protocol, Sequence

import torch


class GrammarMatcher(Protocol):
    """One request's position in its grammar. Tokens are the model's ids; masks are packed int32
    words, bit t % 32 of word t // 32 set when token t may come next."""

    def advance(self, tokens: Sequence[int]) -> bool:
        """Consume `tokens` in order; False (and nothing consumed) when the grammar refuses one."""

    def rollback(self, k: int) -> None:
        """Forget the last `k` consumed tokens."""

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar would take from here, without consuming any."""

    def fill_mask(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into `words`, a contiguous (W,) int32 CPU row."""

    def is_finished(self) -> bool:
        """The grammar took its last token: nothing but EOS may follow."""

    def is_accepting(self) -> bool:
        """What was consumed is a complete match (EOS may come next)."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (jump-forward)."""


class CompiledGrammar(Protocol):
    """A grammar compiled for one vocabulary, shared by every request with the same constraint."""

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(Protocol):
    """A grammar library bound to the node's vocabulary."""

    name: str

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """Compile a constraint (`kind` one of common.sampling.CONSTRAINT_KINDS); raises
        InvalidRequest naming what is wrong with a bad or unsupported grammar."""


def mask_words(vocab_size: int) -> int:
    """int32 words of a packed mask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def checked_json(spec: str) -> str:
    """`spec` when it parses as JSON, else ValueError saying it is not JSON (and where)."""
    try:
        json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    return spec
