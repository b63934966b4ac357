"""Prometheus metrics of the router's HTTP side (prefix `pdserve_router_`, units in the names).

Each app gets its own `CollectorRegistry` (tests create several apps in one process; the global
registry would refuse the duplicate names) and /metrics exposes exactly that registry.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Iterator, Protocol

if TYPE_CHECKING:
    from router.nodes import NodeState

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.loop_lag import LAG_BUCKETS

# Latency buckets: TTFT and e2e span milliseconds (cached prefixes, tiny models) to minutes (long
# generations); inter-token latency lives between a millisecond and a second.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Known paths only, so a scanner probing random URLs cannot blow up the label cardinality.
ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})


class RouterMetrics:
    """The router's HTTP metrics, registered in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # one registry per app (tests build several); the dispatcher's metrics may share it
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests_total",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Generation requests being served now", registry=r)
        self.shed = Counter(
            "pdserve_router_requests_shed_total", "Requests refused because too many were in flight", registry=r
        )
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Time between consecutive output tokens of one choice",
            ["endpoint"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_request_latency_seconds",
            "From request arrival to the last token of a completed request",
            ["endpoint", "disaggregated"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_router_prompt_tokens_total", "Prompt tokens of completed requests", registry=r
        )
        self.completion_tokens = Counter(
            "pdserve_router_completion_tokens_total", "Generated tokens of completed requests", registry=r
        )
        self.errors = Counter(
            "pdserve_router_stream_errors_total",
            "Streams that failed after the first byte (sent as an SSE error event)",
            ["endpoint"],
            registry=r,
        )
        # stage: body (while its request body was read), before_first_token (nothing of the answer
        # sent yet, non-streamed requests included) or streaming (mid-stream)
        self.client_disconnects = Counter(
            "pdserve_router_client_disconnects_total",
            "Clients that went away before their answer was complete, by stage",
            ["stage"],
            registry=r,
        )
        # one event loop relays every stream: its backlog delays them all (common/loop_lag.py),
        # and the process's CPU says whether that loop had a core to itself
        self.loop_lag = Histogram(
            "pdserve_router_event_loop_lag_seconds",
            "How much later than due a 20-ms timer fired on the router's event loop",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        ProcessCollector(registry=r)  # process_cpu_seconds_total and the rest

    def record_response(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def observe_tokens(self, endpoint: str, n_tokens: int, gap_s: float, first: bool, since_start_s: float) -> None:
        """One token event of one choice: TTFT on the first, per-token inter-token latency after."""
        if n_tokens <= 0:
            return
        if first:
            # Tokens arriving with the first one have no predecessor to measure against.
            self.ttft.labels(endpoint).observe(since_start_s)
            return
        # An event may carry several tokens (speculative decoding): spread the gap over them.
        for _ in range(n_tokens):
            self.itl.labels(endpoint).observe(gap_s / n_tokens)

    def observe_done(self, endpoint: str, e2e_s: float, disaggregated: bool, prompt: int, completion: int) -> None:
        self.e2e.labels(endpoint, "true" if disaggregated else "false").observe(e2e_s)
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ResponseCounter:
    """Pure ASGI middleware counting responses by path and status (BaseHTTPMiddleware would wrap
    streaming responses and get in the way of disconnect detection)."""

    def __init__(self, app: Any, metrics: RouterMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.record_response(scope.get("path", ""), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class Balance(Protocol):
    """The tiers' load and capacity, in tokens per second (router/sizing.py's TierBalance)."""

    def prefill_demand(self) -> float: ...

    def prefill_capacity(self) -> float: ...

    def decode_demand(self) -> float: ...

    def decode_capacity(self) -> float: ...

    def ratio(self) -> float: ...

    def prefill_nodes_needed(self) -> float: ...

    def decode_nodes_needed(self) -> float: ...


_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DispatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.retries = Counter(
            "pdserve_router_retries",
            "Attempts retried on a new pair before the first token, by reason",
            ["reason"],
            registry=registry,
        )
        self.pairs = Counter(
            "pdserve_router_pair_selections",
            "Pairs chosen (prefill '-' means a colocated node)",
            ["prefill", "decode"],
            registry=registry,
        )
        self.breaker = Gauge(
            "pdserve_router_breaker_state",
            "Circuit breaker per node: 0 closed, 1 open, 2 half-open (SMG's values)",
            ["node", "role"],
            registry=registry,
        )
        self.node_failures = Counter(
            "pdserve_router_node_failures",
            "Failures charged to a node's breaker, by the reason of the attempt that failed",
            ["node", "role", "reason"],
            registry=registry,
        )
        self.node_up = Gauge(
            "pdserve_router_node_up", "1 when the node's last refresh succeeded", ["node", "role"], registry=registry
        )
        self.ttft_ratio = Gauge(
            "pdserve_router_ttft_estimate_ratio",
            "Observed over estimated time to first token of the prompts the node ran (1: as estimated; "
            "the path decision scales its estimates by it)",
            ["node", "role"],
            registry=registry,
        )
        # TTFT by stage. "prefill" ends when the prefill answers, which it does once its KV write
        # completed, so it holds the node's queue, the prompt forward and the transfer (the nodes'
        # pdserve_kv_transfer_seconds breaks the transfer out); "first_decode" runs from that answer
        # to the first token: the decode's commit + first step when the decode's message brought
        # it, ~0 when the router relayed the token of the prefill's answer (no logprobs asked for),
        # so the stages still add up to the TTFT; "queue" is the router's own pair selection,
        # retries and backoff. first_token_source tells the two cases apart.
        self.ttft_stage = Histogram(
            "pdserve_router_ttft_stage_seconds",
            "Time to first token by stage (first_decode is ~0 when the prefill's answer gave the first token)",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )
        self.first_token_source = Counter(
            "pdserve_router_first_token_source",
            "PD attempts by the leg "
            "whose message gave the client its first token (prefill: its "
            "answer, relayed before the decode streamed)",
            ["source"],
            registry=registry,
        )

        self.ready = Gauge(
            "pdserve_router_ready",
            "1 while /ready answers 200: a compatible pair (or "
            "colocated node) is usable and a handoff succeeded lately",
            registry=registry,
        )
        self._known: set[tuple[str, str]] = set()

    def observe_nodes(self, nodes: list[NodeState]) -> None:
        for n in nodes:
            self.breaker.labels(n.address, n.role).set(int(n.breaker.state))
            self.node_up.labels(n.address, n.role).set(int(n.healthy))
            self.ttft_ratio.labels(n.address, n.role).set(n.ttft.current(time.monotonic()))

    def sync_nodes(self, nodes: list[NodeState]) -> None:
        """All nodes the registry knows now: their gauges set, the series of forgotten ones removed
        (pods come and go behind a headless service; their series must not pile up)."""
        self.observe_nodes(nodes)
        now = {(n.address, n.role) for n in nodes}
        for address, role in self._known - now:
            for gauge in (self.breaker, self.node_up, self.ttft_ratio):
                try:
                    gauge.remove(address, role)
                except KeyError:
                    pass
            pairs = {(s.labels["prefill"], s.labels["decode"]) for m in self.pairs.collect() for s in m.samples}
            for p, d in pairs:
                if address in (p, d):
                    self.pairs.remove(p, d)
            charged = {
                (s.labels["node"], s.labels["role"], s.labels["reason"])
                for m in self.node_failures.collect()
                for s in m.samples
            }
            for node, r, reason in charged:
                if (node, r) == (address, role):
                    self.node_failures.remove(node, r, reason)
        self._known = now


class PathMetrics:
    """Which prefill path requests took and why (router/prefill_path.py), and the tiers' load against
    capacity (router/sizing.py). Label values come from fixed sets, so series stay bounded."""

    def __init__(self, registry: CollectorRegistry, reasons: tuple[str, ...], paths: tuple[str, ...]) -> None:
        self.paths = Counter(
            "pdserve_router_prefill_path",
            "Dispatches by where the prompt ran: remote (a prefill node), local (its decode node), "
            "whole (the whole request on a prefill node: the decode tier at its TPOT budget), "
            "colocated (a colocated node); a retry counts again",
            ["path"],
            registry=registry,
        )
        self.estimates = Histogram(
            "pdserve_router_prefill_path_estimate_seconds",
            "Estimated TTFT of each path when the router chose the path (every estimate known then)",
            ["path"],
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.decisions = Counter(
            "pdserve_router_prefill_path_decisions",
            "Prefill path decisions by reason",
            ["reason"],
            registry=registry,
        )
        for path in paths:  # every series from the start: rates need a zero
            self.paths.labels(path)
        for reason in reasons:
            self.decisions.labels(reason)
        g = functools.partial(Gauge, registry=registry)
        self.prefill_demand = g(
            "pdserve_router_prefill_demand_tokens_per_second",
            "Prompt tokens this router dispatched per second over the last 60 s (remote and local paths)",
        )
        self.prefill_capacity = g(
            "pdserve_router_prefill_capacity_tokens_per_second",
            "Sum of the healthy prefill nodes' measured prompt rates",
        )
        self.decode_demand = g(
            "pdserve_router_decode_demand_tokens_per_second",
            "Output tokens this router streamed per second over the last 60 s",
        )
        self.decode_capacity = g(
            "pdserve_router_decode_capacity_tokens_per_second",
            "Sum of the healthy decode nodes' estimated decode capacities",
        )
        self.balanced_ratio = g(
            "pdserve_router_balanced_prefill_decode_ratio",
            "Prefill nodes per decode node that would balance the current load: (prefill demand / mean "
            "prefill node capacity) / (decode demand / mean decode node capacity); NaN while unknown",
        )

        self.nodes_needed = g(
            "pdserve_router_nodes_needed",
            "Nodes that would carry the last 60 s of load: prefill (prompt tokens/s over a prefill node's "
            "measured rate), decode (output tokens/s over what a decode node emits with its steps within its "
            "TPOT guard, from its step line); NaN while unmeasured",
            ["tier"],
        )

    def bind(self, balance: Balance) -> None:
        """The sizing gauges read `balance` at scrape time."""
        self.nodes_needed.labels("prefill").set_function(balance.prefill_nodes_needed)
        self.nodes_needed.labels("decode").set_function(balance.decode_nodes_needed)
        self.prefill_demand.set_function(balance.prefill_demand)
        self.prefill_capacity.set_function(balance.prefill_capacity)
        self.decode_demand.set_function(balance.decode_demand)
        self.decode_capacity.set_function(balance.decode_capacity)
        self.balanced_ratio.set_function(balance.ratio)

    def observe(self, path: str, reason: str | None, remote_s: float | None, local_s: float | None) -> None:
        """One dispatch: its path, and the decision behind it when one was made (not for colocated)."""
        self.paths.labels(path).inc()
        if reason is not None:
            self.decisions.labels(reason).inc()
        for label, seconds in (("remote", remote_s), ("local", local_s)):
            if seconds is not None:
                self.estimates.labels(label).observe(seconds)


_HIT_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)


class IndexedBlocks(Protocol):
    """The router's KV index (router/kv_index.py): what it holds per node."""

    def indexed_blocks(self) -> list[tuple[str, str, int]]:
        """(address, role, cached blocks) per followed node."""
        ...


class CacheRouteMetrics:
    """What the prefix_aware policy works from: each routed request's expected cache hit where its
    prompt runs, and per node the blocks its KV event stream reported cached (read at scrape time,
    so a forgotten node's series goes with it)."""

    def __init__(self, registry: CollectorRegistry, index: IndexedBlocks) -> None:
        self.expected_hit = Histogram(
            "pdserve_router_expected_cache_hit_tokens",
            "Prompt tokens the node chosen to run a request's prompt was expected to hold in its prefix "
            "cache (from its KV events); a retry counts again",
            buckets=_HIT_BUCKETS,
            registry=registry,
        )
        registry.register(_IndexedBlocksCollector(index))


class _IndexedBlocksCollector(Collector):
    def __init__(self, index: IndexedBlocks) -> None:
        self.index = index

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "pdserve_router_indexed_kv_blocks",
            "KV blocks (pages) a node's event stream reported in its prefix cache",
            labels=["node", "role"],
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for address, role, blocks in self.index.indexed_blocks():
            family.add_metric([address, role], blocks)
        yield family
