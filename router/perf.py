"""What a node measured of its own speed (GetServerInfo's `perf`), the router's own prompt tokens in
flight to it, and how the prompts it ran compared with the router's estimates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def _rate(value: Any) -> float:
    """A non-negative finite number, else 0 (unknown): a node's report is never trusted to be well formed."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value) if math.isfinite(value) and value > 0 else 0.0


def _steps(value: Any) -> tuple[tuple[int, float], ...]:
    """{"batch size": seconds} -> sorted (batch size, seconds); entries that are not both positive are dropped."""
    if not isinstance(value, dict):
        return ()
    out: dict[int, float] = {}
    for key, seconds in value.items():
        try:
            size = int(float(key))
        except (TypeError, ValueError):
            continue
        if size >= 1 and (s := _rate(seconds)) > 0:
            out[size] = s
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class NodePerf:
    """A node's measured rates; 0 (or empty, or None) is unknown. Older nodes and SGLang workers report none."""

    prefill_tokens_per_s: float = 0.0
    prompt_overhead_s: float = 0.0  # what a prompt batch costs beyond its tokens at the rate
    decode_step_s: tuple[tuple[int, float], ...] = ()  # (batch size, seconds per step), sorted by size
    decode_tokens_per_step: float = 0.0  # 1 plain, the mean accept length with speculation
    decode_capacity_tokens_per_s: float = 0.0
    tpot_guard_s: float | None = None  # None: the node runs no prompts beside its decode batch
    # its prompt chunks run inside its decode steps (no fixed part each), at this marginal rate (0: unmeasured)
    mixed_chunk: bool = False
    mixed_tokens_per_s: float = 0.0

    @staticmethod
    def parse(value: Any) -> NodePerf:
        """From server_args["perf"] (already a plain dict); anything missing or malformed reads as unknown."""
        if not isinstance(value, dict):
            return NodePerf()
        guard = _rate(value.get("tpot_guard_s"))
        return NodePerf(
            prefill_tokens_per_s=_rate(value.get("prefill_tokens_per_s")),
            prompt_overhead_s=_rate(value.get("prompt_overhead_s")),
            decode_step_s=_steps(value.get("decode_step_s")),
            decode_tokens_per_step=_rate(value.get("decode_tokens_per_step")),
            decode_capacity_tokens_per_s=_rate(value.get("decode_capacity_tokens_per_s")),
            tpot_guard_s=guard if guard > 0 else None,
            mixed_chunk=value.get("mixed_chunk") is True,
            mixed_tokens_per_s=_rate(value.get("mixed_tokens_per_s")),
        )

    def step_s(self, batch_size: int) -> float | None:
        """Decode step seconds at `batch_size`: linear between the measured sizes around it, along the
        last two beyond the largest (never below its time), the smallest's below it (a smaller batch
        is no slower to step: an upper bound); None when nothing is measured."""
        points = self.decode_step_s
        if not points:
            return None
        if batch_size <= points[0][0] or len(points) == 1:
            return points[0][1]  # one measured size: the best guess at any size
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if batch_size <= x1:
                return y0 + (y1 - y0) * (batch_size - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return max(y1, y1 + (y1 - y0) * (batch_size - x1) / (x1 - x0))


@dataclass
class PromptLedger:
    """Prompt tokens this router sent a node whose first token has not come back yet, by attempt. Each
    attempt is one entry, taken out once, so the sums never go negative however often it is settled.
    An entry keeps the whole prompt (the KV it will hold) and the part the node is expected to compute
    (less its expected prefix-cache hit): counted whole, each cached turn in flight added its whole
    history to the node's queue (0.1 s for 4,000 tokens at 40K tokens/s) and could send the next
    turn away from its own history."""

    # attempt -> (tokens, to compute, sent at); keyed by the attempt object: clients may reuse request ids
    entries: dict[object, tuple[int, int, float]] = field(default_factory=dict)

    def add(self, key: object, tokens: int, now: float, cached: int = 0) -> None:
        tokens = max(0, tokens)
        self.entries[key] = (tokens, max(min(tokens, 1), tokens - max(0, cached)), now)

    def settle(self, key: object) -> None:
        self.entries.pop(key, None)

    def total(self) -> int:
        """Whole prompts: the KV they will hold."""
        return sum(tokens for tokens, _, _ in self.entries.values())

    def since(self, reported_at: float) -> int:
        """The tokens to compute of those sent after the node's last load report (earlier ones are in
        its queued count already)."""
        return sum(computed for _, computed, at in self.entries.values() if at >= reported_at)


# A TTFT estimate below this is mostly the router's and the network's own overhead: not observed.
CALIBRATION_MIN_ESTIMATE_S = 0.02
CALIBRATION_WEIGHT = 0.2  # each observation's share of the ratio
CALIBRATION_BOUNDS = (0.5, 20.0)
# Unobserved, the ratio relaxes towards 1 with this half-life: a path that the ratio made look slow
# is then tried, and measured, again.
CALIBRATION_HALF_LIFE_S = 30.0


@dataclass
class TtftCalibration:
    """Observed over estimated time to first token of the prompts a node ran (an exponentially
    weighted ratio, 1 until observed): the estimates come from rates measured one batch at a time,
    and miss what they do not model (a decode node's prompt chunks waiting for slack, host time)."""

    ratio: float = 1.0
    at: float = 0.0  # monotonic time of the last observation

    def current(self, now: float) -> float:
        if self.at <= 0:
            return self.ratio
        return 1.0 + (self.ratio - 1.0) * 0.5 ** (max(0.0, now - self.at) / CALIBRATION_HALF_LIFE_S)

    def observe(self, observed_s: float, estimated_s: float, now: float) -> None:
        if estimated_s < CALIBRATION_MIN_ESTIMATE_S or observed_s < 0:
            return
        low, high = CALIBRATION_BOUNDS
        seen = min(high, max(low, observed_s / estimated_s))
        self.ratio = self.current(now) + CALIBRATION_WEIGHT * (seen - self.current(now))
        self.at = now
