"""Load against capacity of the prefill and decode tiers, and the prefill:decode node ratio that would balance it."""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from router.nodes import NodeRegistry
from router.perf import NodePerf

WINDOW_S = 60.0
# The window of the load the router acts on (router/pooling.py): short enough to follow a change of
# traffic within seconds, long enough to hold tens of requests at the rates where it matters.
RECENT_WINDOW_S = 5.0
# Beyond this batch a decode node's capacity is not searched (no node runs more at once).
MAX_BATCH = 4096


class RateWindow:
    """Events per second over the last `window_s` seconds, in one-second buckets (bounded memory
    at any traffic). Until the window has filled once, the time since the first event divides."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._buckets: collections.deque[list[float]] = collections.deque()  # [second, count], oldest first
        self._first: float | None = None

    def add(self, n: float) -> None:
        now = self.clock()
        if self._first is None:
            self._first = now
        second = math.floor(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, n])
        self._trim(now)

    def per_second(self) -> float:
        now = self.clock()
        self._trim(now)
        if self._first is None:
            return 0.0
        span = min(self.window_s, max(1.0, now - self._first))
        return sum(n for _, n in self._buckets) / span

    def _trim(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.window_s - 1:
            self._buckets.popleft()


def guard_batch(perf: NodePerf) -> int | None:
    """The largest batch whose measured decode step fits a decode node's TPOT guard (the guard per
    token a request gains per step); 0 when even one request steps past it, None when unknown."""
    guard = perf.tpot_guard_s
    if guard is None or not perf.decode_step_s:
        return None
    cycle = guard * (perf.decode_tokens_per_step or 1.0)
    if (perf.step_s(1) or 0.0) > cycle:
        return 0
    low, high = 1, MAX_BATCH  # step_s grows with the batch: the last batch within the cycle
    while low < high:
        mid = (low + high + 1) // 2
        if (perf.step_s(mid) or 0.0) <= cycle:
            low = mid
        else:
            high = mid - 1
    return low


def decode_capacity_within_guard(perf: NodePerf) -> float:
    """Output tokens/s a decode node serves with its steps within its TPOT guard: guard_batch's
    batch times the tokens a request gains per step, over its step (its reported capacity at its
    --max-running when it has no guard; 0: unknown)."""
    batch = guard_batch(perf)
    if batch is None:
        return perf.decode_capacity_tokens_per_s
    step = perf.step_s(batch) if batch else None
    if not step:
        return 0.0
    within = batch * (perf.decode_tokens_per_step or 1.0) / step
    # past its measured batches the step line is extrapolated; the node's own figure at its
    # --max-running (no more run at once) bounds it
    reported = perf.decode_capacity_tokens_per_s
    return min(within, reported) if reported > 0 else within


def _mean_capacity(capacities: Sequence[float]) -> float:
    measured = [c for c in capacities if c > 0]
    return sum(measured) / len(measured) if measured else 0.0


def balanced_ratio(
    prefill_demand: float, prefill_capacities: Sequence[float], decode_demand: float, decode_capacities: Sequence[float]
) -> float:
    """Prefill nodes per decode node that would carry the current load: (prefill demand / mean
    prefill node capacity) / (decode demand / mean decode node capacity). NaN when unknown: no
    decode demand, or no measured capacity in either tier."""
    per_prefill, per_decode = _mean_capacity(prefill_capacities), _mean_capacity(decode_capacities)
    if per_prefill <= 0 or per_decode <= 0 or decode_demand <= 0:
        return math.nan
    return (prefill_demand / per_prefill) / (decode_demand / per_decode)


@dataclass(frozen=True)
class TierLoad:
    """Recent demand over capacity of each tier as the deployment is split (NaN: unknown), and the
    node counts, from which the load of every node serving both (pooled) follows."""

    prefill: float  # prompt tokens/s to compute over the prefill nodes' prompt rates
    decode: float  # output tokens/s over the decode nodes' capacity within their TPOT guard
    prefill_nodes: int
    decode_nodes: int
    # the decode nodes' running requests now over the batches their guard allows: the decode tier's
    # load without the rates' window, which takes its length to follow a rise
    decode_batch: float = math.nan

    @property
    def pooled(self) -> float:
        """The same work spread over every node, each computing prompts and decoding (same GPUs)."""
        return self.spread(self.decode)

    def spread(self, decode: float) -> float:
        """The load of every node pooled, were the decode tier's load `decode`."""
        n = self.prefill_nodes + self.decode_nodes
        return (self.prefill * self.prefill_nodes + decode * self.decode_nodes) / n if n else math.nan


class TierBalance:
    """Prompt tokens dispatched (either path) and output tokens streamed, against the healthy
    nodes' measured capacities; read by the router's sizing gauges at scrape time. Over the last
    RECENT_WINDOW_S too, with the prompts' expected cache hits left out: the load it acts on."""

    def __init__(self, registry: NodeRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.prompts, self.outputs = RateWindow(clock=clock), RateWindow(clock=clock)
        self.recent_prompts = RateWindow(RECENT_WINDOW_S, clock)
        self.recent_outputs = RateWindow(RECENT_WINDOW_S, clock)

    def add_prompt(self, tokens: int, cached: int = 0) -> None:
        """A prompt dispatched to PD nodes, of which `cached` tokens are expected to be hits."""
        self.prompts.add(tokens)
        self.recent_prompts.add(max(0, tokens - cached))

    def add_output(self, tokens: int) -> None:
        self.outputs.add(tokens)
        self.recent_outputs.add(tokens)

    def recent_load(self) -> TierLoad:
        """The tiers' load over the last RECENT_WINDOW_S (router/pooling.py decides on it)."""
        prefills, decodes = self.registry.nodes("prefill"), self.registry.nodes("decode")
        prompt_rate = sum(n.perf.prefill_tokens_per_s for n in prefills)
        decode_rate = sum(decode_capacity_within_guard(n.perf) for n in decodes)
        batches = [guard_batch(n.perf) for n in decodes]
        allowed = sum(b for b in batches if b is not None)
        running = sum(max(n.running, n.inflight) for n, b in zip(decodes, batches) if b is not None)
        return TierLoad(
            self.recent_prompts.per_second() / prompt_rate if prompt_rate > 0 else math.nan,
            self.recent_outputs.per_second() / decode_rate if decode_rate > 0 else math.nan,
            len(prefills),
            len(decodes),
            running / allowed if allowed > 0 else math.nan,
        )

    def _prefill_capacities(self) -> list[float]:
        return [n.perf.prefill_tokens_per_s for n in self.registry.nodes("prefill")]  # healthy ones

    def _decode_capacities(self) -> list[float]:
        return [n.perf.decode_capacity_tokens_per_s for n in self.registry.nodes("decode")]

    def prefill_demand(self) -> float:
        return self.prompts.per_second()

    def decode_demand(self) -> float:
        return self.outputs.per_second()

    def prefill_capacity(self) -> float:
        return sum(self._prefill_capacities())

    def decode_capacity(self) -> float:
        return sum(self._decode_capacities())

    def ratio(self) -> float:
        return balanced_ratio(
            self.prefill_demand(), self._prefill_capacities(), self.decode_demand(), self._decode_capacities()
        )
