"""Load against capacity of the prefill and decode tiers, and the prefill:decode node ratio that would balance it."""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Sequence

from router.nodes import NodeRegistry
from router.tier_load import TierLoad, nodes_needed, tier_load

WINDOW_S = 60.0
# The window of the load the router acts on (router/pooling.py): short enough to follow a change of
# traffic within seconds, long enough to hold tens of requests at the rates where it matters.
RECENT_WINDOW_S = 5.0


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


class TierBalance:
    """Prompt tokens dispatched (either path) and output tokens streamed, against the healthy
    nodes' measured capacities; read by the router's sizing gauges at scrape time. Over the last
    RECENT_WINDOW_S too, with the prompts' expected cache hits left out: the load it acts on."""

    def __init__(self, registry: NodeRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.prompts, self.outputs = RateWindow(clock=clock), RateWindow(clock=clock)
        self.recent_prompts = RateWindow(RECENT_WINDOW_S, clock)
        self.recent_local_prompts = RateWindow(RECENT_WINDOW_S, clock)  # of them, on a decode node
        self.recent_outputs = RateWindow(RECENT_WINDOW_S, clock)

    def add_prompt(self, tokens: int, cached: int = 0, on_decode: bool = False) -> None:
        """A prompt dispatched to PD nodes, of which `cached` tokens are expected to be hits;
        `on_decode`: a decode node computes it (the local path)."""
        self.prompts.add(tokens)
        self.recent_prompts.add(max(0, tokens - cached))
        if on_decode:
            self.recent_local_prompts.add(max(0, tokens - cached))

    def add_output(self, tokens: int) -> None:
        self.outputs.add(tokens)
        self.recent_outputs.add(tokens)

    def recent_load(self) -> TierLoad:
        """The tiers' load over the last RECENT_WINDOW_S (router/pooling.py decides on it)."""
        return tier_load(
            self.registry.nodes("prefill"),
            self.registry.nodes("decode"),
            self.recent_prompts.per_second(),
            self.recent_outputs.per_second(),
            self.recent_local_prompts.per_second(),
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

    def nodes_needed(self) -> tuple[float, float]:
        """(prefill, decode) nodes that would carry the last 60 s of load (router/tier_load.py)."""
        return nodes_needed(
            self.registry.nodes("prefill"), self.registry.nodes("decode"), self.prefill_demand(), self.decode_demand()
        )

    def prefill_nodes_needed(self) -> float:
        return self.nodes_needed()[0]

    def decode_nodes_needed(self) -> float:
        return self.nodes_needed()[1]

    def ratio(self) -> float:
        return balanced_ratio(
            self.prefill_demand(), self._prefill_capacities(), self.decode_demand(), self._decode_capacities()
        )
