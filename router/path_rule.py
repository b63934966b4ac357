"""The thresholds of the router's `auto` path policy (router/prefill_path.py decides with them)."""

from __future__ import annotations

from dataclasses import dataclass

from common.defaults import DEFAULT_PAGE_SIZE


@dataclass(frozen=True)
class PathRule:
    """`auto`'s thresholds: follow-ups computing at most `local_max_tokens` on the decode that holds
    their history run there when that is not slower, or, computing at most `history_max_tokens`,
    when the decode holds `history_min_tokens` more of it than the prefill and its estimate is
    within `history_target_s`; others run there only when the prefill's estimated TTFT is over
    `remote_target_s` and local's is under `overflow_margin` of it."""

    local_max_tokens: int = 256
    # A turn sent to the prefill recomputes what only the decode holds (the last turn's reply, and
    # whole turns that ran locally): on two H100s, turns alternating between the paths took PD's
    # reuse from 0.94 to 0.88 (bench/RESULTS.md, the ninth prefix-cache run). Within this TTFT a
    # follow-up stays where more of its history is, by at least `history_min_tokens`: one page, the
    # least a cache can hold (at 64, every turn after a remote one lost its 48-token reply: reuse
    # 0.88 on two H200s, the tenth run). The guard keeps the local chunk within TPOT.
    history_target_s: float = 0.2
    history_min_tokens: int = DEFAULT_PAGE_SIZE
    # ...computing at most this many tokens there (at least `local_max_tokens`): held to 256, chat
    # turns of 257-348 new tokens went to the prefill, which recomputed the history only the decode
    # held (PD reuse 0.87 on two H200s, twelfth prefix-cache run; 0.96 at 512, the thirteenth).
    history_max_tokens: int = 512
    remote_target_s: float = 0.2
    # Overflow needs local's estimate under this share of remote's: it assumes the decode's guard
    # spends all its requests' slack on prompts, and on an H100 under load local prompts took
    # several times their estimate (bench/RESULTS.md, the fifth goodput run).
    overflow_margin: float = 0.5
    # The same two for a decode node whose chunks ride inside its decode steps (`mixed_chunk`): its
    # guard holds every step within its TPOT whatever the step computes, so a local prompt costs
    # its running requests only what the guard allows, and the faster path wins.
    mixed_remote_target_s: float = 0.0
    mixed_overflow_margin: float = 1.0

    def __post_init__(self) -> None:
        targets = (self.remote_target_s, self.mixed_remote_target_s, self.history_target_s)
        margins = (self.overflow_margin, self.mixed_overflow_margin)
        counts = (self.local_max_tokens, self.history_min_tokens, self.history_max_tokens)
        if min(counts) < 0 or min(targets) < 0 or not all(0 < m <= 1 for m in margins):
            raise ValueError(
                f"the token counts and the targets must be >= 0 and the overflow margins in (0, 1], got {self}"
            )

    def overflow(self, mixed_chunk: bool) -> tuple[float, float]:
        """(remote target s, overflow margin) for a decode node that mixes its chunks or not."""
        if mixed_chunk:
            return self.mixed_remote_target_s, self.mixed_overflow_margin
        return self.remote_target_s, self.overflow_margin


DEFAULT_RULE = PathRule()
