"""Speculative decoding counters: verifies, drafts proposed and accepted, accepted-length histogram.

Monotonic counts (Prometheus `rate()` can window them) plus the means derived from them. Any
verifying executor keeps one and reports it through `Executor.spec_stats()`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    max_drafts: int  # drafts along the longest path a verify can accept (at start-up)
    verifies: int = 0  # request-verifies (one per request per step)
    accepted_drafts: int = 0
    proposed_drafts: int = 0  # drafts along the verified paths' longest branch, summed
    accept_len_hist: Counter[int] = field(default_factory=Counter)  # accept_len -> count

    def record(self, accept_lens: list[int], drafts_per_req: int | None = None) -> None:
        """One verify step: accepted lengths (correct drafts + 1) of its requests; each request
        was offered `drafts_per_req` drafts along its longest path (default: max_drafts)."""
        self.verifies += len(accept_lens)
        self.accepted_drafts += sum(a - 1 for a in accept_lens)
        per_req = self.max_drafts if drafts_per_req is None else drafts_per_req
        self.proposed_drafts += per_req * len(accept_lens)
        self.accept_len_hist.update(accept_lens)

    def record_uniform(self, accept_len: int, n: int, drafts_per_req: int | None = None) -> None:
        """`record([accept_len] * n, drafts_per_req)` without building the list."""
        if n <= 0:
            return
        self.verifies += n
        self.accepted_drafts += (accept_len - 1) * n
        self.proposed_drafts += (self.max_drafts if drafts_per_req is None else drafts_per_req) * n
        self.accept_len_hist[accept_len] += n

    def reset(self) -> None:
        """Zero the counts (a node's warm-up verifies are no one's acceptance)."""
        self.verifies = self.accepted_drafts = self.proposed_drafts = 0
        self.accept_len_hist.clear()

    @property
    def mean_accept_len(self) -> float:
        """Tokens emitted per request per target forward (correct drafts + the bonus)."""
        return 1.0 + self.accepted_drafts / self.verifies if self.verifies else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0
