"""Measured speed of this node: prompt tokens/s, decode step time by batch size, tokens per step.

The scheduler times every batch from launch (or the previous batch's end, whichever is later) to
the moment its results are on the host, so with overlap on each batch is charged only its own
device time. The figures feed the TPOT guard (engine/scheduler/tpot_guard.py), the load report
the router decides each request's prefill path from, and the sizing gauges.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque

from engine.core import Batch, ForwardMode, StepOutput
from engine.scheduler.stats import STEP_BUCKETS, BatchTimes

log = logging.getLogger(__name__)

# Each observation keeps this share of what came before: recent batches dominate, one odd batch
# (a first-touch compile, a tiny probe) fades within a few dozen.
DECAY = 0.9
# Batch sizes are bucketed by powers of two: decode step time grows slowly with batch size.
MAX_BUCKET = 1 << 12
RATE_WINDOW_S = 10.0
# A prompt batch of a few tokens costs a whole forward (the weights are read once either way), so
# its tokens/s says nothing of the node's prompt rate: a router probe or a cached follow-up of
# one token measured 6 tokens/s on a GPU that computes 40,000. Batches count towards the rate from
# half the largest of the last RECENT_BATCHES prompt batches, and from this many tokens at the most.
# Recent, not ever: a decode node whose TPOT guard cuts prompts into small chunks must still
# measure them, or a rate read low once (a compile) would keep its chunks small for good.
RATE_MIN_TOKENS = 512
RECENT_BATCHES = 64
# The prompt rate is the median of the last few counted batches' own rates: one batch that paid a
# first-touch kernel compile (seconds) must not decide it. As a ratio of decayed sums it did: its
# seconds dominated the sum, a decode node's rate read 288 tokens/s for minutes on an H100, and
# the TPOT guard, sizing chunks by that rate, cut its prompts to 32-token chunks.
RATE_SAMPLES = 9
# A prompt batch's fixed part (the weights read once, every layer launched from the host) is what a
# batch of at most this many tokens costs beyond its tokens at the rate: the median of the last
# RATE_SAMPLES such batches.
OVERHEAD_MAX_TOKENS = 128
# A mixed batch (a prompt chunk inside a decode step) tells the chunk's marginal rate: its tokens
# over what the batch took beyond a decode step of its size. Chunks of fewer tokens say little.
MIXED_MIN_TOKENS = 64
# A chunk's share of a mixed step is charged at most what the chunk would cost run apart (the
# prompt batch's fixed part plus its tokens at the prompt rate): mixing exists because it costs
# less. One slow mixed step (a first-touch compile, a host stall) charged in full read a decode
# node's mixed rate as 1,201 tokens/s on an H100 (against 54-66K profiled); the guard then sized
# chunks below MIXED_MIN_TOKENS, none was measured again, and the router priced every local prompt
# at seconds. Such a step is logged (at most every MIXED_SLOW_LOG_S) with its figures.
MIXED_SLOW_LOG_S = 30.0
# And at least 1 / (MIXED_MAX_SPEEDUP x the prompt rate) per token: a chunk's tokens go through the
# same GEMMs a prompt batch's do (profiled on an H100: 54-66K tokens/s inside decode steps against
# about 40K in prompt batches of their own). Faster readings come from a decode step priced above
# what it cost beside the chunk; one decode node read 185K tokens/s and priced its chunks by it.
MIXED_MAX_SPEEDUP = 2.0
# A chunk's mixed rate is measured only while the node runs local prompts, and the router sends it
# local prompts only while that rate says they are cheap: a rate read low once (mixed steps at a
# large batch) stood for minutes on two H200s, and the router sent every prompt to a saturated
# prefill node (TTFT p90 0.4-2 s) while the decode node ran at 6 ms TPOT against a 13.5 ms guard.
# Readings older than this are forgotten, and the prompt rate stands in until chunks are measured
# again at the batch the node runs now.
MIXED_FRESH_S = 20.0


def bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size` (1, 2, 4, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


class _Decayed:
    """A ratio of exponentially decayed sums (e.g. tokens over seconds)."""

    __slots__ = ("num", "den")

    def __init__(self) -> None:
        self.num = self.den = 0.0

    def add(self, num: float, den: float) -> None:
        self.num = self.num * DECAY + num
        self.den = self.den * DECAY + den

    def ratio(self) -> float:
        return self.num / self.den if self.den > 0 else 0.0


class RecentRate:
    """Events per second over the last `window_s` seconds (per-second bins)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._bins: deque[list[float]] = deque()  # [second, count]
        self._start = time.monotonic()

    def add(self, count: float, now: float | None = None) -> None:
        second = float(int(now if now is not None else time.monotonic()))
        if self._bins and self._bins[-1][0] == second:
            self._bins[-1][1] += count
        else:
            self._bins.append([second, count])
        self._trim(second)

    def per_second(self, now: float | None = None) -> float:
        now = now if now is not None else time.monotonic()
        self._trim(now)
        span = min(self.window_s, max(1.0, now - self._start))
        return sum(c for _, c in list(self._bins)) / span

    def _trim(self, now: float) -> None:
        while self._bins and self._bins[0][0] <= now - self.window_s:
            self._bins.popleft()


class NodeRates:
    """What this node's batches measured; written by the scheduler thread, read by any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step_time = BatchTimes(STEP_BUCKETS)  # each batch's charged seconds, by kind (node metrics)
        self._start()

    def _start(self) -> None:
        self._prefill: deque[float] = deque(maxlen=RATE_SAMPLES)  # tokens/s of prompt batches big enough to tell
        self._recent_prompt_batches: deque[int] = deque(maxlen=RECENT_BATCHES)  # their tokens
        self._small: deque[tuple[int, float]] = deque(maxlen=RATE_SAMPLES)  # (tokens, seconds) of small ones
        self._mixed: deque[tuple[float, float]] = deque(maxlen=RATE_SAMPLES)  # (when, a chunk's marginal tokens/s)
        self._steps: dict[int, _Decayed] = {}  # bucket -> seconds / decode steps
        self._sizes: dict[int, _Decayed] = {}  # bucket -> batch sizes / decode steps (where it was measured)
        self._per_step = _Decayed()  # tokens a request gains / decode steps
        self._last_done = 0.0  # perf_counter when the last batch's results reached the host
        self._slow_logged_at = -MIXED_SLOW_LOG_S  # when a mixed step slower than apart was last logged
        self._decode_tokens = RecentRate()  # demand served: tokens emitted, prompt tokens computed
        self._prompt_tokens = RecentRate()

    def reset(self) -> None:
        """Forget every measurement (a node's warm-up, after the batches that paid for compiles)."""
        with self._lock:
            self._start()

    def forget_demand(self) -> None:
        """Forget the recent tokens served (the warm-up's are no one's demand); speeds stay."""
        with self._lock:
            self._decode_tokens, self._prompt_tokens = RecentRate(), RecentRate()

    def batch_done(self, batch: Batch, out: StepOutput, launched_at: float, launch_s: float = 0.0) -> None:
        """A batch's results reached the host (scheduler thread): it is charged the time from its
        launch (perf_counter), or from the previous batch's end when it queued behind that one on
        the device, and at least its own launch's `launch_s` of host time. A host-bound launch (an
        eager forward's ~400 launches, tens of ms) runs its kernels as it issues them, and the
        previous batch is collected only after it: charged from that collection, such a batch cost
        next to nothing, and an EAGLE decode node on two H200s read its prompt rate as 132-311K
        tokens/s (its 800-token prompts launched in 47 ms, charged 11-14)."""
        now = time.perf_counter()
        seconds, self._last_done = max(now - max(launched_at, self._last_done), launch_s), now
        self.step_time.observe(batch.mode, seconds)
        if batch.mode is ForwardMode.MIXED:
            decoded = sum(len(t) for t in out.tokens[: batch.decode_rows])
            self.observe_mixed(batch.decode_rows, batch.prompt_tokens, decoded, seconds)
            return
        tokens = batch.num_tokens if batch.mode is ForwardMode.EXTEND else sum(len(t) for t in out.tokens)
        self.observe(batch.mode, len(batch.reqs), tokens, seconds)

    def observe_mixed(self, decode_rows: int, prompt_tokens: int, decoded: int, seconds: float) -> None:
        """One mixed batch: the tokens it served, and its chunk's marginal rate when it can tell."""
        step = self.decode_step_s(decode_rows)  # before the lock: it takes it
        with self._lock:
            self._prompt_tokens.add(prompt_tokens)
            self._decode_tokens.add(decoded)
            if step is None or prompt_tokens < MIXED_MIN_TOKENS or seconds <= step:
                return
            chunk_s = seconds - step
            if not self._prefill:  # nothing to bound it by yet
                self._mixed.append((time.monotonic(), prompt_tokens / chunk_s))
                return
            prompt_rate = statistics.median(self._prefill)
            apart_s = self._overhead_s(prompt_rate) + prompt_tokens / prompt_rate  # the chunk as its own batch
            if chunk_s > apart_s:
                self._log_slow_mixed(decode_rows, prompt_tokens, seconds, step, apart_s)
                chunk_s = apart_s
            self._mixed.append((time.monotonic(), min(prompt_tokens / chunk_s, MIXED_MAX_SPEEDUP * prompt_rate)))

    def _overhead_s(self, prompt_rate: float) -> float:
        """`prompt_overhead_s` at the median `prompt_rate`, under the lock."""
        if not self._small:
            return 0.0
        return max(0.0, statistics.median(s - n / prompt_rate for n, s in self._small))

    def _log_slow_mixed(self, rows: int, tokens: int, seconds: float, step: float, apart_s: float) -> None:
        now = time.monotonic()
        if now - self._slow_logged_at < MIXED_SLOW_LOG_S:
            return
        self._slow_logged_at = now
        log.warning(
            "a mixed step took %.2f ms for %d decode rows and a %d-token chunk: %.2f ms beyond a decode step "
            "(%.2f ms), more than the chunk costs apart (%.2f ms); charged as apart",
            seconds * 1e3, rows, tokens, (seconds - step) * 1e3, step * 1e3, apart_s * 1e3,
        )  # fmt: skip

    def observe(self, mode: ForwardMode, batch_size: int, tokens: int, seconds: float) -> None:
        """One batch: its mode, requests, tokens (computed prompt tokens, or tokens emitted by a
        decode step) and the device seconds it took."""
        if seconds <= 0 or batch_size <= 0:
            return
        with self._lock:
            if mode is ForwardMode.EXTEND:
                self._recent_prompt_batches.append(tokens)
                if tokens >= min(RATE_MIN_TOKENS, max(self._recent_prompt_batches) // 2):
                    self._prefill.append(tokens / seconds)
                if tokens <= OVERHEAD_MAX_TOKENS:
                    self._small.append((tokens, seconds))
                self._prompt_tokens.add(tokens)
            elif mode is ForwardMode.DECODE:
                b = min(bucket(batch_size), MAX_BUCKET)
                self._steps.setdefault(b, _Decayed()).add(seconds, 1.0)
                self._sizes.setdefault(b, _Decayed()).add(batch_size, 1.0)
                self._per_step.add(tokens / batch_size, 1.0)
                self._decode_tokens.add(tokens)

    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of computing prompts (0: none measured)."""
        with self._lock:
            return statistics.median(self._prefill) if self._prefill else 0.0

    def prompt_overhead_s(self) -> float:
        """Seconds a prompt batch costs beyond its tokens at the prompt rate (0: unknown)."""
        with self._lock:
            return self._overhead_s(statistics.median(self._prefill)) if self._prefill else 0.0

    def mixed_tokens_per_s(self, now: float | None = None) -> float:
        """Prompt tokens per second a chunk costs inside a decode step (0: none measured in the
        last MIXED_FRESH_S seconds)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            fresh = [rate for at, rate in self._mixed if now - at <= MIXED_FRESH_S]
            return statistics.median(fresh) if fresh else 0.0

    def recent_decode_tokens_per_s(self) -> float:
        """Tokens emitted per second over the last few seconds."""
        with self._lock:
            return self._decode_tokens.per_second()

    def recent_prompt_tokens_per_s(self) -> float:
        """Prompt tokens computed per second over the last few seconds."""
        with self._lock:
            return self._prompt_tokens.per_second()

    def decode_tokens_per_step(self) -> float:
        """Tokens a request gains per decode step: 1 plain, the accept length speculative (0: unknown)."""
        with self._lock:
            return self._per_step.ratio()

    def step_times(self) -> dict[int, float]:
        """Measured decode step seconds by batch-size bucket."""
        with self._lock:
            return {b: d.ratio() for b, d in sorted(self._steps.items())}

    def step_line(self) -> dict[int, float]:
        """Measured decode step seconds by the (rounded, decayed) mean batch size each bucket's
        steps ran at: a bucket's time belongs where it was measured, not at its upper bound (a
        bucket of 129-256 measured near 140 put there made every step just above 128 look as
        fast as one at 100, and the guard, pricing chunks by it, overran its TPOT)."""
        with self._lock:
            return {round(self._sizes[b].ratio()): d.ratio() for b, d in sorted(self._steps.items())}

    def decode_step_s(self, batch_size: int) -> float | None:
        """Decode step seconds at `batch_size`: linear between the measured sizes around it,
        extended along the last two beyond them (None: nothing measured)."""
        return interpolate(self.step_line(), batch_size)

    def decode_capacity_tokens_per_s(self, max_running: int) -> float:
        """Decode tokens/s at `max_running` requests, from the step-time line (0: unknown)."""
        step, per_step = self.decode_step_s(max_running), self.decode_tokens_per_step()
        return max_running * per_step / step if step and per_step else 0.0

    def snapshot(self, max_running: int) -> dict[str, object]:
        """The figures a load report carries (the router's `perf`)."""
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s(),
            "prompt_overhead_s": self.prompt_overhead_s(),
            "mixed_tokens_per_s": self.mixed_tokens_per_s(),
            "decode_step_s": {str(b): s for b, s in self.step_line().items()},
            "decode_tokens_per_step": self.decode_tokens_per_step(),
            "decode_capacity_tokens_per_s": self.decode_capacity_tokens_per_s(max_running),
        }


def interpolate(points: dict[int, float], x: int) -> float | None:
    """Piecewise-linear through `points` (x -> y), extended along the last two past the largest and
    never below its y (two close sizes measured a little apart extrapolated a step of 0 at
    --max-running, as the router's NodePerf.step_s does not); below the smallest, its y (a smaller
    batch's step is no slower: an upper bound)."""
    if not points:
        return None
    xs = sorted(points)
    if len(xs) == 1 or x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(b for b in xs if b >= x)
        lo = xs[xs.index(hi) - 1]
    slope = (points[hi] - points[lo]) / (hi - lo)
    floor = points[hi] if x > hi else 0.0
    return max(floor, points[lo] + slope * (x - lo))
