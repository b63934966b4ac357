"""Prometheus metrics of a node (prefix `pdserve_`, units in names), served on --metrics-port.

Transfer metrics are process-wide counters/histograms updated by the PD handlers; engine state
(queues, KV usage, speculative acceptance) is read when scraped, so the hot loop pays nothing.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)

KV_TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes", "KV page and aux row bytes written to "
                            "decode nodes (prefill) / received (decode)", ["role"])
KV_TRANSFER_SECONDS = Histogram("pdserve_kv_transfer_seconds", "Prefill: write posted -> completed. "
                                "Decode: destination sent -> KV landed", ["role"], buckets=_LATENCY_BUCKETS)
KV_TRANSFER_FAILURES = Counter("pdserve_kv_transfer_failures", "PD requests that failed before "
                               "decoding, by reason", ["role", "reason"])
BOOTSTRAP_ATTEMPTS = Counter("pdserve_bootstrap_attempts", "Handshake attempts from a decode node "
                             "to prefill nodes", ["result"])


class EngineCollector(Collector):
    """Scheduler queues, KV usage and speculative acceptance of one engine, read at scrape time."""

    def __init__(self, engine: Any, role: str) -> None:
        self.engine, self.role = engine, role

    def collect(self) -> Iterator[GaugeMetricFamily]:
        eng = self.engine
        policy, kv = eng.scheduler.policy, eng.kv
        yield _gauge("pdserve_node_running_requests", "Requests with KV in the running batch",
                     self.role, len(policy.running))
        yield _gauge("pdserve_node_waiting_requests", "Requests queued for admission", self.role,
                     len(policy.waiting))
        yield _gauge("pdserve_kv_cache_used_tokens", "KV cache tokens in use (whole pages)", self.role,
                     kv.allocator.num_used * kv.page_size)
        yield _gauge("pdserve_kv_cache_capacity_tokens", "KV cache capacity in tokens", self.role,
                     kv.allocator.total * kv.page_size)
        stats = eng.executor.spec_stats()
        if stats is not None:
            yield _gauge("pdserve_spec_accept_length", "Mean tokens per verify (accepted drafts + 1)",
                         self.role, stats.mean_accept_len)
            yield _gauge("pdserve_spec_acceptance_ratio", "Accepted drafts / drafts proposed", self.role,
                         stats.acceptance_rate)


def _gauge(name: str, doc: str, role: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["role"])
    g.add_metric([role], value)
    return g


def start_metrics(engine: Any, role: str, host: str, port: int) -> int:
    """Serve /metrics over HTTP; returns the bound port (0 picks a free one)."""
    REGISTRY.register(EngineCollector(engine, role))
    server, _ = start_http_server(port, addr=host)
    return int(server.server_address[1])
