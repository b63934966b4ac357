"""`--stream-interval auto`: tokens per streamed message from the node's own streamed token rate.

Every message a node streams costs the router a read, a relay and an SSE write on its one event
loop (about 60-70 us of its CPU). A fixed interval trades every client's granularity for the
router's relief at all loads; auto asks for it only when the node streams more tokens a second
than its message budget (`--stream-messages-per-s`): one token a message while the rate is under
it, then as many as keep the messages within it. On two H200s, four tokens a message on every node
kept the router under a core where one a message had saturated it (bench/RESULTS.md, the
twenty-eighth goodput run); the default budget keeps a node's relay near a fifth of a core.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.defaults import DEFAULT_STREAM_MESSAGES_PER_S as DEFAULT_MESSAGES_PER_S

WINDOW_S = 0.5  # the rate is re-read this often: a load change reaches the interval within it
MOST_TOKENS = 16  # a message never waits for more (at 10 ms a token, 160 ms between messages)


class StreamPacer:
    """The node's streamed tokens counted as they are handed to streams; `interval` is what a
    message gathers after a stream's first: `fixed` where set (`--stream-interval N`), else (auto)
    from the last window's token rate against the message budget. Used on the event loop only."""

    def __init__(
        self,
        fixed: int | None = None,
        messages_per_s: float = DEFAULT_MESSAGES_PER_S,
        window_s: float = WINDOW_S,
        most: int = MOST_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fixed is not None and fixed < 1:
            raise ValueError(f"--stream-interval must be >= 1 or auto, got {fixed}")
        if messages_per_s <= 0:
            raise ValueError(f"--stream-messages-per-s must be > 0, got {messages_per_s:g}")
        self.fixed, self.messages_per_s, self.window_s, self.most = fixed, messages_per_s, window_s, most
        self._clock = clock
        self._since, self._tokens = clock(), 0
        self.interval = fixed or 1
        self.tokens_per_s = 0.0

    def observe(self, tokens: int) -> None:
        """Tokens handed to a streaming request (per update); a window's end re-reads the rate."""
        self._tokens += tokens
        now = self._clock()
        if now - self._since < self.window_s:
            return
        self.tokens_per_s = self._tokens / (now - self._since)
        self._since, self._tokens = now, 0
        if self.fixed is None:
            self.interval = max(1, min(self.most, math.ceil(self.tokens_per_s / self.messages_per_s)))


class PacerCollector(Collector):
    """The interval and the streamed token rate, as of the pacer's last window (read, not settled:
    the pacer belongs to the event loop, a scrape to the metrics thread)."""

    def __init__(self, pacer: Callable[[], StreamPacer], role: str) -> None:
        self.pacer, self.role = pacer, role  # the node's pacer at scrape time (flags may replace it)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        interval = GaugeMetricFamily(
            "pdserve_node_stream_interval_tokens",
            "Tokens a streamed message gathers after its first (--stream-interval; auto: from the rate)",
            labels=["role"],
        )
        pacer = self.pacer()
        interval.add_metric([self.role], pacer.interval)
        rate = GaugeMetricFamily(
            "pdserve_node_streamed_tokens_per_second",
            "Tokens a second this node handed to streaming requests, over the stream pacer's last window",
            labels=["role"],
        )
        rate.add_metric([self.role], pacer.tokens_per_s)
        yield interval
        yield rate
