"""Prometheus metrics of a node (prefix `pdserve_`, units in names), served on --metrics-port.

Transfer metrics are process-wide counters/histograms updated by the PD handlers; engine state
(queues, KV usage, queue time, finish reasons, speculative counters) is read when scraped, so the
hot loop pays nothing. deploy/prometheus and deploy/grafana query these names.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from engine.service.stream import stream_pacer
from engine.service.stream_pacer import PacerCollector

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

KV_TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes",
    "KV page and aux row bytes written to decode nodes (prefill) / received (decode)",
    ["role"],
)
KV_TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds",
    "Prefill: write posted -> completed. Decode: destination sent -> KV landed",
    ["role"],
    buckets=_LATENCY_BUCKETS,
)
KV_HANDOFF_TAIL_SECONDS = Histogram(
    "pdserve_kv_handoff_tail_seconds",
    "Prefill: last prompt chunk computed -> final KV write completed (what the handoff adds to TTFT)",
    buckets=_LATENCY_BUCKETS,
)
KV_HANDOFF_STAGE_SECONDS = Histogram(
    "pdserve_kv_handoff_stage_seconds",
    "Prefill: the handoff tail "
    "by stage: handover (engine's finishing update -> the handler), check (the destination "
    "checked against the prompt), encode (handoff row payload), settle (chunk writes ended), row "
    "(row written); the final write itself is pdserve_kv_transfer_seconds",
    ["stage"],
    buckets=_LATENCY_BUCKETS,
)
KV_WRITES = Counter(
    "pdserve_kv_writes",
    "KV writes posted to decode nodes: chunk (pages of a prompt "
    "chunk, sent while the prompt still runs) or final (remaining pages + handoff row)",
    ["kind"],
)
KV_WRITE_PAGES = Counter(
    "pdserve_kv_write_pages", "KV pages written to decode nodes, by write kind (chunk or final)", ["kind"]
)
KV_TRANSFER_SKIPPED_PAGES = Counter(
    "pdserve_kv_transfer_skipped_pages",
    "Decode: prompt pages its prefix cache held already, so the prefill node did not write them",
)
KV_DESTINATION_RUNS = Histogram(
    "pdserve_kv_destination_runs",
    "Decode: runs of consecutive pages a prompt's KV is written into (each run is one copy per "
    "layer and K|V: scattered destinations turn a handoff into many small copies)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
KV_WRITE_RUNS = Histogram(
    "pdserve_kv_write_runs",
    "Prefill: runs of pages consecutive on both sides that one KV write carries, by write kind "
    "(chunk or final); each is one copy per layer and K|V",
    ["kind"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
KV_TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures", "PD requests that failed before decoding, by reason", ["role", "reason"]
)
BOOTSTRAP_ATTEMPTS = Counter(
    "pdserve_bootstrap_attempts", "Handshake attempts from a decode node to prefill nodes", ["result"]
)


class EngineCollector(Collector):
    """Scheduler queues, KV usage, request outcomes and speculative counters of one engine, read at
    scrape time. `handler` is the node role's Generate handler: its `disaggregation_metrics()` has
    the PD queues (the same numbers GetLoads reports to routers)."""

    def __init__(self, engine: Any, role: str, handler: Any = None) -> None:
        self.engine, self.role, self.handler = engine, role, handler

    def collect(self) -> Iterator[Metric]:
        eng, role = self.engine, self.role
        policy, kv = eng.scheduler.policy, eng.kv
        yield _gauge(
            "pdserve_node_running_requests", "Requests with KV in the running batch", role, len(policy.running)
        )
        yield _gauge("pdserve_node_waiting_requests", "Requests queued for admission", role, len(policy.waiting))
        used, total = kv.num_held * kv.page_size, kv.allocator.total * kv.page_size
        yield _gauge(
            "pdserve_kv_cache_used_tokens",
            "KV cache tokens requests hold or read (whole pages; cached pages nobody reads are free)",
            role,
            used,
        )
        yield _gauge("pdserve_kv_cache_capacity_tokens", "KV cache capacity in tokens", role, total)
        yield _gauge(
            "pdserve_kv_cache_usage_ratio", "KV cache tokens in use / capacity", role, used / total if total else 0.0
        )
        slots = kv.cfg.max_reqs
        yield _gauge(
            "pdserve_node_request_slots_used",
            "Admission slots held: running requests, and PD requests reserving or receiving KV",
            role,
            slots - kv.num_free_slots,
        )
        yield _gauge("pdserve_node_request_slots_capacity", "Admission slots (--max-running)", role, slots)
        yield from self._pd_queues()
        yield _histogram(
            "pdserve_node_queue_time_seconds",
            "Waiting queue -> admitted to a batch, per admission (a retracted request waits again)",
            role,
            eng.scheduler.queue_time,
        )
        yield _histogram(
            "pdserve_node_prompt_seconds",
            "First admission -> first token: the prompt's forward passes, every chunk, and the first sample",
            role,
            eng.scheduler.prompt_time,
        )
        yield _histograms(
            "pdserve_node_launch_seconds",
            "Host time to launch one batch on the device (overlap off: to run it), by kind: prompt (a chunk of "
            "its own), mixed (a chunk inside a decode step) or decode",
            role,
            "kind",
            eng.scheduler.launch_time.by_kind,
        )
        yield _histograms(
            "pdserve_node_step_seconds",
            "Time charged to one batch: from its launch, or the previous batch's end, to its results on the host "
            "(what the node's rates and TPOT guard are measured from), by kind as pdserve_node_launch_seconds",
            role,
            "kind",
            eng.rates.step_time.by_kind,
        )
        yield _counter(
            "pdserve_node_mixed_steps",
            "Decode steps that ran a prompt chunk in the same forward (a decode node's own prompts)",
            role,
            eng.scheduler.stats["mixed_steps"],
        )
        yield self._graph_forwards()
        yield _counter(
            "pdserve_node_retractions",
            "Running requests sent back to the queue because the KV cache ran out",
            role,
            eng.scheduler.stats["retractions"],
        )
        finished = CounterMetricFamily(
            "pdserve_node_finished_requests",
            "Requests that ended, by finish reason (abort: cancelled or failed)",
            labels=["role", "reason"],
        )
        for reason, n in sorted(eng.io.finished_counts().items()):
            finished.add_metric([role, reason], n)
        yield finished
        yield _gauge(
            "pdserve_model_load_seconds",
            "Engine construction at start-up: weights, draft, KV pool, CUDA graphs",
            role,
            eng.load_seconds,
        )
        yield from self._speculative()
        yield from self._rates()
        yield from self._prefix_cache()

    def _graph_forwards(self) -> Metric:
        """The target model's forwards on a node with CUDA graphs: replayed, or eager and why (an
        eager forward of the 8B shape costs ~20 ms of host launches beyond its graph's)."""
        stats = self.engine.parts.runner.graph_stats
        reasons = dict(stats.eager_reasons)  # one C-level copy: the scheduler thread adds reasons
        c = CounterMetricFamily(
            "pdserve_node_graph_forwards",
            "Target-model forwards where CUDA graphs are on: replayed from a graph, or run eagerly (by reason)",
            labels=["role", "path", "reason"],
        )
        c.add_metric([self.role, "replay", ""], stats.hits)
        for reason, n in sorted(reasons.items()):
            c.add_metric([self.role, "eager", reason], n)
        return c

    def _prefix_cache(self) -> Iterator[Metric]:
        """What prompts found in the prefix cache, and what the cache holds."""
        eng, role = self.engine, self.role
        stats = eng.scheduler.stats
        yield _counter(
            "pdserve_node_admitted_prompt_tokens",
            "Prompt tokens of admitted requests (at their first admission)",
            role,
            stats["admitted_prompt_tokens"],
        )
        yield _counter(
            "pdserve_node_cached_prompt_tokens",
            "Of them, tokens found in the prefix cache (not computed)",
            role,
            stats["cached_prompt_tokens"],
        )
        yield _histogram(
            "pdserve_node_cached_prompt_tokens_per_request",
            "Prompt tokens each request found in the prefix cache",
            role,
            eng.scheduler.cached_per_request,
        )
        cache = eng.kv.cache
        if cache is None:  # --disable-radix-cache
            return
        yield _gauge("pdserve_prefix_cache_pages", "KV pages the prefix cache holds", role, cache.num_pages)
        yield _gauge(
            "pdserve_prefix_cache_evictable_pages",
            "Of them, pages no running request reads (given to new requests when space runs short)",
            role,
            cache.num_evictable,
        )
        yield _counter(
            "pdserve_prefix_cache_inserted_pages", "Pages the prefix cache took", role, cache.stats["inserted_pages"]
        )
        yield _counter(
            "pdserve_prefix_cache_evicted_pages",
            "Pages the prefix cache gave back for lack of space (least recently used first)",
            role,
            cache.stats["evicted_pages"],
        )

    def _rates(self) -> Iterator[Metric]:
        """Load against capacity, for sizing the prefill and decode tiers (engine/scheduler/rates.py)."""
        eng, role = self.engine, self.role
        rates = eng.rates
        yield _gauge(
            "pdserve_node_waiting_prompt_tokens",
            "Prompt tokens queued and not computed yet (waiting requests and unfinished chunks)",
            role,
            eng.scheduler.policy.queued_prompt_tokens,
        )
        yield _gauge(
            "pdserve_node_prefill_capacity_tokens_per_second",
            "Measured prompt tokens per second of computing prompts (0: none measured yet)",
            role,
            rates.prefill_tokens_per_s(),
        )
        yield _gauge(
            "pdserve_node_mixed_prefill_tokens_per_second",
            "Measured marginal prompt tokens per second of a chunk run inside a decode step (0: none in the last 20 s)",
            role,
            rates.mixed_tokens_per_s(),
        )
        yield _gauge(
            "pdserve_node_decode_capacity_tokens_per_second",
            "Decode tokens per second at --max-running requests, from the measured step times (0: unknown)",
            role,
            rates.decode_capacity_tokens_per_s(eng.config.max_running),
        )
        yield _gauge(
            "pdserve_node_prompt_tokens_per_second",
            "Prompt tokens computed per second over the last 10 s",
            role,
            rates.recent_prompt_tokens_per_s(),
        )
        yield _gauge(
            "pdserve_node_decode_tokens_per_second",
            "Tokens emitted by decode steps per second over the last 10 s",
            role,
            rates.recent_decode_tokens_per_s(),
        )
        steps = GaugeMetricFamily(
            "pdserve_node_decode_step_seconds",
            "Measured decode step time by batch-size bucket (a power of two at or above the batch size)",
            labels=["role", "batch_size"],
        )
        for size, seconds in rates.step_times().items():
            steps.add_metric([role, str(size)], seconds)
        yield steps

    def _pd_queues(self) -> Iterator[Metric]:
        disagg = self.handler.disaggregation_metrics() if self.handler is not None else None
        if disagg is None:  # colocated: no PD queues
            return
        g = GaugeMetricFamily(
            "pdserve_pd_queue_requests",
            "PD requests by queue. Decode: prealloc "
            "(waiting for KV pages), transfer (waiting for the prefill's write). "
            "Prefill: prealloc (waiting for a destination), transfer (computing or "
            "writing)",
            labels=["role", "queue"],
        )
        if self.role == "decode":
            g.add_metric([self.role, "prealloc"], disagg.decode_prealloc_queue_reqs)
            g.add_metric([self.role, "transfer"], disagg.decode_transfer_queue_reqs)
        else:
            g.add_metric([self.role, "prealloc"], disagg.prefill_prealloc_queue_reqs)
            g.add_metric([self.role, "transfer"], disagg.prefill_inflight_queue_reqs)
        yield g

    def _speculative(self) -> Iterator[Metric]:
        executor = self.engine.executor
        stats = executor.spec_stats()
        if stats is not None:
            role = self.role
            yield _gauge(
                "pdserve_spec_accept_length",
                "Mean tokens per verify (accepted drafts + 1) since start-up",
                role,
                stats.mean_accept_len,
            )
            yield _gauge(
                "pdserve_spec_acceptance_ratio",
                "Accepted drafts / drafts proposed since start-up",
                role,
                stats.acceptance_rate,
            )
            # Counters, so rate() gives windowed values: accept length = 1 + accepted / verifies,
            # acceptance rate = accepted / drafts.
            yield _counter(
                "pdserve_spec_verifies", "Request-verifies (one per request per target forward)", role, stats.verifies
            )
            yield _counter(
                "pdserve_spec_accepted_tokens", "Draft tokens the target accepted", role, stats.accepted_drafts
            )
            yield _counter(
                "pdserve_spec_draft_tokens",
                "Draft tokens proposed along the verified path",
                role,
                stats.proposed_drafts,
            )
        yield from self._adaptive(executor.adaptive_snapshot())

    def _adaptive(self, snap: dict[str, Any] | None) -> Iterator[Metric]:
        """Adaptive speculation: per batch-size slot (its smallest batch size) the step count in
        force and the EMA of accepted drafts; switches since start-up."""
        if not snap:
            return
        steps = GaugeMetricFamily(
            "pdserve_spec_adaptive_steps",
            "Draft steps the adaptive policy chose, per batch-size slot",
            labels=["role", "slot"],
        )
        ema = GaugeMetricFamily(
            "pdserve_spec_adaptive_ema_accepted",
            "EMA of accepted drafts per request, per batch-size slot",
            labels=["role", "slot"],
        )
        for slot in snap["slots"]:
            steps.add_metric([self.role, str(slot["lower_bound"])], slot["current_steps"])
            ema.add_metric([self.role, str(slot["lower_bound"])], slot["ema"])
        yield steps
        yield ema
        yield _counter(
            "pdserve_spec_adaptive_switches", "Step-count switches of the adaptive policy", self.role, snap["switches"]
        )


def _gauge(name: str, doc: str, role: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["role"])
    g.add_metric([role], value)
    return g


def _counter(name: str, doc: str, role: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["role"])
    c.add_metric([role], value)
    return c


def _histogram(name: str, doc: str, role: str, hist: Any) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=["role"])
    _add_snapshot(h, [role], hist)
    return h


def _histograms(name: str, doc: str, role: str, label: str, hists: dict[str, Any]) -> HistogramMetricFamily:
    """One family over several histograms, one per value of `label`."""
    h = HistogramMetricFamily(name, doc, labels=["role", label])
    for value, hist in hists.items():
        _add_snapshot(h, [role, value], hist)
    return h


def _add_snapshot(h: HistogramMetricFamily, labels: list[str], hist: Any) -> None:
    buckets, total = hist.snapshot()
    h.add_metric(labels, [(_le(b), n) for b, n in buckets], total)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def start_metrics(engine: Any, role: str, host: str, port: int, handler: Any = None) -> int:
    """Serve /metrics over HTTP; returns the bound port (0 picks a free one)."""
    REGISTRY.register(EngineCollector(engine, role, handler))
    REGISTRY.register(PacerCollector(stream_pacer, role))
    server, _ = start_http_server(port, addr=host)
    return int(server.server_address[1])
