"""The TPOT guard: when, and how many, prompt tokens may run on a node that decodes.

A decode node that also runs prompts (the router's local path) puts prompt chunks between its
decode steps. A chunk is a forward of its own, so it costs a fixed part (the weights read once,
and on the host the launch of every layer: for an 8B model on an H100 about 6.5 ms with prompt
graphs, 13-40 ms without, as much as a decode step or more) plus its tokens at the measured
prompt rate. Sizing every chunk to fit one step's
share of the budget made chunks small, their fixed part dominant, and the decode slower than the
guard promised (bench/RESULTS.md). So the guard spends slack instead:

- Each decoding request keeps a slack: `tpot_s` per token it has gained since the guard first saw
  it decoding, minus the time that took, plus what its next steps will earn (at most HORIZON
  tokens, each `tpot_s` minus the step's share). A request on budget has slack >= 0 at its end.
- A chunk runs when every decoding request's slack pays for it; it takes as many tokens as the
  smallest slack pays for (fixed part included), at most the node's chunk size. Chunks are then
  few and large, and each request's mean time per output token stays within `tpot_s`.
- A chunk too small to be worth its fixed part waits for slack to grow, unless it would finish the
  prompt; after STARVE_STEPS steps without one, a prompt advances by MIN_CHUNK regardless (the
  router stops sending prompts to a node whose steps alone fill its budget).
Until the rates are measured a small fixed chunk alternates with each step.

On a node that runs its chunk inside the decode step (a MIXED batch, the default; off with
`--disable-mixed-chunk`) a chunk has no fixed part: the weights are read once for both. There
every step keeps within the guard instead: a chunk takes what the decode step leaves of `tpot_s`
(per token a request gains per step), at the node's measured mixed rate (its prompt rate until
that is measured), and any chunk is worth running. Spending slack there, decode TPOT p50 reached
22.8 ms under a 12 ms guard on two H100s (bench/RESULTS.md: each new request arrives with HORIZON
tokens of credit); per step, a prompt gets the share of the node the router's local estimate
assumes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from engine.core import Req
from engine.scheduler.rates import MIXED_MIN_TOKENS

log = logging.getLogger(__name__)

# Before any measurement: small enough for a few milliseconds on any GPU this serves.
UNMEASURED_CHUNK = 256
# A prompt always advances by at least this much every STARVE_STEPS decode steps; inside a decode
# step by a chunk the node's rates still measure (MIXED_MIN_TOKENS), so a mixed rate read low once
# is read again rather than keeping every chunk too small to be measured.
MIN_CHUNK = 32
STARVE_STEPS = 32
# The smallest chunk worth its fixed part (unless the prompt needs less).
EFFICIENT_CHUNK = 256
# Tokens of a request's future steps whose earnings the guard may spend now: bounds how far ahead
# a request pays (one that ends earlier than its max_new_tokens pays at most this much).
HORIZON = 32
# A prompt held back by the guard is logged at most this often (seconds): why it waits, in figures.
DENIAL_LOG_S = 5.0


class Rates(Protocol):
    """The measured speeds the guard reads (engine.scheduler.rates.NodeRates has them)."""

    def prefill_tokens_per_s(self) -> float: ...

    def prompt_overhead_s(self) -> float: ...

    def mixed_tokens_per_s(self) -> float: ...

    def decode_step_s(self, batch_size: int) -> float | None: ...

    def decode_tokens_per_step(self) -> float: ...


@dataclass
class TpotGuard:
    tpot_s: float  # the time per output token running requests keep while prompts interleave
    rates: Rates
    max_chunk: int  # the node's chunked prefill size
    _since: dict[str, tuple[float, int]] = field(default_factory=dict)  # rid -> (first seen, tokens then)
    _denied: int = 0  # decode steps run since a prompt last advanced
    _logged_at: float = -DENIAL_LOG_S  # when a denial was last logged (time.monotonic)

    def chunk_tokens(self, decoding: Sequence[Req], want: int, now: float | None = None, *, mixed: bool = False) -> int:
        """Prompt tokens the next batch may compute with `decoding` requests decoding and a prompt
        that needs `want` more tokens (`mixed`: inside their decode step); 0: a decode step alone."""
        rate, step = self.rates.prefill_tokens_per_s(), self.rates.decode_step_s(len(decoding))
        if rate <= 0 or step is None:
            return min(UNMEASURED_CHUNK, self.max_chunk)
        now = time.monotonic() if now is None else now
        if mixed:  # what this step leaves of the guard, at the chunk's marginal rate
            spare = self.tpot_s * max(1.0, self.rates.decode_tokens_per_step()) - step
            fits = int(spare * (self.rates.mixed_tokens_per_s() or rate))
        else:
            spare = self.slack_s(decoding, step, now) - self.rates.prompt_overhead_s()
            fits = int(spare * rate)
        tokens = min(self.max_chunk, fits)
        if tokens >= min(want, MIN_CHUNK if mixed else EFFICIENT_CHUNK):
            self._denied = 0
            return tokens
        if self._denied >= STARVE_STEPS:
            self._denied = 0
            return max(MIXED_MIN_TOKENS if mixed else MIN_CHUNK, tokens)
        self._denied += 1
        if now - self._logged_at >= DENIAL_LOG_S:
            self._logged_at = now
            log.info(
                "TPOT guard holds a prompt back: %d decoding, step %.2f ms against %.1f ms x %.2f tokens/step, "
                "%.2f ms to spare at %.0f tokens/s (mixed %.0f): %d of %d tokens fit (%s)",
                len(decoding), step * 1e3, self.tpot_s * 1e3, self.rates.decode_tokens_per_step(), spare * 1e3,
                rate, self.rates.mixed_tokens_per_s(), fits, want, "mixed" if mixed else "own forward",
            )  # fmt: skip
        return 0

    def slack_s(self, decoding: Sequence[Req], step: float, now: float) -> float:
        """The smallest slack among `decoding` (seconds); requests seen for the first time start now."""
        per_step = max(1.0, self.rates.decode_tokens_per_step())
        earn = self.tpot_s - step / per_step  # what each future token earns
        live = {r.rid for r in decoding}
        for rid in [rid for rid in self._since if rid not in live]:
            del self._since[rid]
        smallest = float("inf")
        for r in decoding:
            gained = len(r.output_ids)
            since, base = self._since.setdefault(r.rid, (now, gained))
            ahead = min(HORIZON, max(0, r.params.max_new_tokens - gained))
            smallest = min(smallest, self.tpot_s * (gained - base) - (now - since) + ahead * earn)
        return smallest
