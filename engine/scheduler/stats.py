"""Cumulative duration histograms the scheduler thread fills and a metrics scrape reads."""

from __future__ import annotations

import bisect
import threading

from engine.core import ForwardMode

# Launching one batch takes tens of microseconds (a graphed decode step) to tens of milliseconds
# (a long prompt chunk, launched layer by layer).
LAUNCH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# A batch's charged time: a decode step of a few ms to a long prompt's forward of a second or more.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0, 2.5)
# Queue time spans sub-millisecond (idle node) to minutes (a saturated one).
# The scheduler's counters (Scheduler.stats); admitted and cached prompt tokens count each request
# once, at its first admission.
COUNTERS = (
    "steps",
    "retractions",
    "decode_tokens",
    "prefill_tokens",
    "discarded",
    "overlap_syncs",
    "grammar_settles",
    "failed_steps",
    "admitted_prompt_tokens",
    "cached_prompt_tokens",
    "mixed_steps",  # decode steps that carried a prompt chunk (MIXED batches)
)
# Prompt tokens a request found in the prefix cache: none, a system prompt, a long conversation.
CACHED_TOKEN_BUCKETS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class DurationHistogram:
    """Counts per upper bound (not cumulative), sum and count, like a Prometheus histogram.

    The engine stays free of the metrics library: the node's collector turns a `snapshot()` into
    exposition at scrape time. A lock keeps a scrape from seeing a half-applied observation."""

    def __init__(self, bounds: tuple[float, ...] = QUEUE_TIME_BUCKETS) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def reset(self) -> None:
        with self._lock:
            self._counts, self._sum = [0] * len(self._counts), 0.0

    def snapshot(self) -> tuple[list[tuple[float, int]], float]:
        """([(upper bound, cumulative count)] ending with (inf, total), sum of observations)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts):
            running += n
            out.append((bound, running))
        return out, total


class BatchTimes:
    """Seconds per batch by kind: a prompt batch of its own, a mixed one (a chunk inside a decode
    step) or any other (decode, verify, draft). As the host time to launch one, beside the prompt's
    own time, they tell a launch-bound prompt (its forward waits on the host) from a device-bound
    one; as the time each batch is charged (engine/scheduler/rates.py), what a mixed step costs in
    serving against a decode step."""

    KINDS = ("prompt", "mixed", "decode")

    def __init__(self, bounds: tuple[float, ...] = LAUNCH_BUCKETS) -> None:
        self.by_kind = {kind: DurationHistogram(bounds) for kind in self.KINDS}

    def reset(self) -> None:
        for hist in self.by_kind.values():
            hist.reset()

    def observe(self, mode: ForwardMode, seconds: float) -> None:
        kind = "mixed" if mode is ForwardMode.MIXED else "prompt" if mode is ForwardMode.EXTEND else "decode"
        self.by_kind[kind].observe(seconds)
