"""Speculative decoding counters: accepted length per verify and acceptance rate."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    max_drafts: int  # drafts along the longest path a verify can accept (num_steps)
    verifies: int = 0  # request-verifies (one per request per step)
    accepted_drafts: int = 0
    accept_len_hist: Counter[int] = field(default_factory=Counter)  # accept_len -> count

    def record(self, accept_lens: list[int]) -> None:
        self.verifies += len(accept_lens)
        self.accepted_drafts += sum(a - 1 for a in accept_lens)
        self.accept_len_hist.update(accept_lens)

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per request per target forward (correct drafts + the bonus)."""
        return 1.0 + self.accepted_drafts / self.verifies if self.verifies else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / (self.verifies * self.max_drafts) if self.verifies else 0.0
