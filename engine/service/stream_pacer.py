"""The node's stream pacing as metrics: `--stream-interval` (auto: common/stream_pacer.py) and the
streamed token rate behind it.

On two H200s, four tokens a message on every node kept the router under a core where one a message
had saturated it (bench/RESULTS.md, the twenty-eighth goodput run); the default budget keeps a
node's relay near a fifth of a core.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.stream_pacer import StreamPacer


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
