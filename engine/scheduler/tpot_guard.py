"""The TPOT guard: how many prompt tokens may run between two decode steps on a node that decodes.

A decode node that also runs prompts (the router's local path) alternates one prompt chunk with
one decode step. Its running requests then see a token every `step + chunk` seconds per step's
worth of tokens, so keeping their time per output token within `tpot_s` bounds the chunk to
`tpot_s * tokens_per_step - step(batch size)` seconds of prompt, which the measured prompt rate
turns into tokens. Until the rates are measured a small fixed chunk runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Before any measurement: small enough for a few milliseconds on any GPU this serves.
UNMEASURED_CHUNK = 256
# A prompt always advances by at least this much per cycle, even on a decode node already at its
# budget (the router stops sending it prompts then; those it has still finish).
MIN_CHUNK = 32


class Rates(Protocol):
    """The measured speeds the guard reads (engine.scheduler.rates.NodeRates has them)."""

    def prefill_tokens_per_s(self) -> float: ...

    def decode_step_s(self, batch_size: int) -> float | None: ...

    def decode_tokens_per_step(self) -> float: ...


@dataclass(frozen=True)
class TpotGuard:
    tpot_s: float  # the time per output token running requests keep while prompts interleave
    rates: Rates
    max_chunk: int  # the node's chunked prefill size

    def chunk_tokens(self, batch_size: int) -> int:
        """Prompt tokens the next chunk may compute with `batch_size` requests decoding."""
        rate, step = self.rates.prefill_tokens_per_s(), self.rates.decode_step_s(batch_size)
        if rate <= 0 or step is None:
            return min(UNMEASURED_CHUNK, self.max_chunk)
        cycle = self.tpot_s * max(1.0, self.rates.decode_tokens_per_step())
        return max(MIN_CHUNK, min(self.max_chunk, int((cycle - step) * rate)))
