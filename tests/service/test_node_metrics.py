"""The node collector's exposition from engine state, on stand-in objects (no model): histogram
buckets of the queue time, launch times by kind, graph replays and eager forwards, counters from SpecStats, PD
queues, adaptive steps when exposed."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.core import ForwardMode
from engine.graph_buffers import GraphStats
from engine.scheduler.rates import NodeRates
from engine.scheduler.stats import CACHED_TOKEN_BUCKETS, COUNTERS, BatchTimes, DurationHistogram
from engine.service.metrics import EngineCollector
from engine.spec_stats import SpecStats


def _engine(executor: Any) -> Any:
    hist = DurationHistogram((0.01, 0.1, 1.0))
    for s in (0.005, 0.05, 0.05, 3.0):
        hist.observe(s)
    kv = SimpleNamespace(
        allocator=SimpleNamespace(num_used=3, total=12),
        num_held=3,
        cache=None,  # --disable-radix-cache: no cache gauges
        page_size=16,
        cfg=SimpleNamespace(max_reqs=8),
        num_free_slots=6,
    )
    prompt = DurationHistogram((0.01, 0.1, 1.0))
    prompt.observe(0.02)
    launches = BatchTimes()
    for mode, seconds in [
        (ForwardMode.EXTEND, 0.02),
        (ForwardMode.DECODE, 0.0002),
        (ForwardMode.TARGET_VERIFY, 0.0003),
    ]:
        launches.observe(mode, seconds)
    rates = NodeRates()
    for mode, seconds in [(ForwardMode.DECODE, 0.012), (ForwardMode.MIXED, 0.025), (ForwardMode.MIXED, 0.015)]:
        rates.step_time.observe(mode, seconds)
    sched = SimpleNamespace(
        policy=SimpleNamespace(running=[1, 2], waiting=[3], queued_prompt_tokens=0),
        queue_time=hist,
        prompt_time=prompt,
        launch_time=launches,
        stats={**dict.fromkeys(COUNTERS, 0), "retractions": 4, "mixed_steps": 7},
        cached_per_request=DurationHistogram(CACHED_TOKEN_BUCKETS),
    )
    io = SimpleNamespace(finished_counts=lambda: {"stop": 5, "abort": 2})
    graphs = GraphStats(hits=40, captures=3, eager=5, eager_reasons=Counter({"mixed batch larger than its buckets": 5}))
    return SimpleNamespace(
        scheduler=sched,
        kv=kv,
        io=io,
        executor=executor,
        load_seconds=1.5,
        rates=rates,
        config=SimpleNamespace(max_running=8),
        parts=SimpleNamespace(runner=SimpleNamespace(graph_stats=graphs)),
    )


def _registry(engine: Any, role: str, handler: Any = None) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(EngineCollector(engine, role, handler))
    return reg


def test_queue_time_histogram_counts_and_state_gauges() -> None:
    plain = SimpleNamespace(spec_stats=lambda: None, adaptive_snapshot=lambda: None)
    reg = _registry(_engine(plain), "colocated")
    v = lambda name, **labels: reg.get_sample_value(name, {"role": "colocated", **labels})  # noqa: E731
    assert [v("pdserve_node_queue_time_seconds_bucket", le=le) for le in ("0.01", "0.1", "1.0", "+Inf")] == [1, 3, 3, 4]
    assert (
        v("pdserve_node_queue_time_seconds_count") == 4 and abs(v("pdserve_node_queue_time_seconds_sum") - 3.105) < 1e-9
    )
    assert v("pdserve_node_prompt_seconds_count") == 1 and v("pdserve_node_prompt_seconds_bucket", le="0.1") == 1
    assert (
        v("pdserve_node_launch_seconds_count", kind="prompt") == 1
        and v("pdserve_node_launch_seconds_count", kind="decode") == 2
    )
    assert v("pdserve_node_launch_seconds_bucket", kind="prompt", le="0.01") == 0
    assert abs(v("pdserve_node_launch_seconds_sum", kind="decode") - 0.0005) < 1e-12
    assert v("pdserve_node_launch_seconds_count", kind="mixed") == 0
    # a mixed step's charged time beside a decode step's: what a chunk costs in serving
    assert v("pdserve_node_step_seconds_count", kind="mixed") == 2
    assert v("pdserve_node_step_seconds_count", kind="decode") == 1
    assert abs(v("pdserve_node_step_seconds_sum", kind="mixed") - 0.040) < 1e-12
    assert v("pdserve_node_step_seconds_bucket", kind="mixed", le="0.015") == 1
    assert v("pdserve_kv_cache_usage_ratio") == 0.25
    assert v("pdserve_node_request_slots_used") == 2 and v("pdserve_node_request_slots_capacity") == 8
    assert v("pdserve_node_retractions_total") == 4 and v("pdserve_model_load_seconds") == 1.5
    assert v("pdserve_node_mixed_steps_total") == 7
    assert v("pdserve_node_graph_forwards_total", path="replay", reason="") == 40
    assert v("pdserve_node_graph_forwards_total", path="eager", reason="mixed batch larger than its buckets") == 5
    assert v("pdserve_node_mixed_prefill_tokens_per_second") == 0.0  # none measured
    assert v("pdserve_node_finished_requests_total", reason="abort") == 2
    assert reg.get_sample_value("pdserve_pd_queue_requests", {"role": "colocated", "queue": "prealloc"}) is None
    assert v("pdserve_spec_verifies_total") is None  # no speculative stats, no series


def test_speculative_counters_pd_queues_and_adaptive_steps() -> None:
    stats = SpecStats(max_drafts=4)
    stats.record([3, 1, 5])  # accepted drafts 2 + 0 + 4
    snap = {
        "slots": [
            {"lower_bound": 1, "current_steps": 4, "ema": 2.5},
            {"lower_bound": 8, "current_steps": 2, "ema": 1.25},
        ],
        "switches": 7,
    }
    executor = SimpleNamespace(spec_stats=lambda: stats, adaptive_snapshot=lambda: snap)
    handler = SimpleNamespace(
        disaggregation_metrics=lambda: pb.DisaggregationMetrics(
            mode="decode", decode_prealloc_queue_reqs=2, decode_transfer_queue_reqs=1
        )
    )
    reg = _registry(_engine(executor), "decode", handler)
    v = lambda name, **labels: reg.get_sample_value(name, {"role": "decode", **labels})  # noqa: E731
    assert v("pdserve_spec_verifies_total") == 3 and v("pdserve_spec_accepted_tokens_total") == 6
    assert v("pdserve_spec_draft_tokens_total") == 12  # 3 verifies x 4 steps
    assert (
        v("pdserve_pd_queue_requests", queue="prealloc") == 2 and v("pdserve_pd_queue_requests", queue="transfer") == 1
    )
    assert v("pdserve_spec_adaptive_steps", slot="1") == 4 and v("pdserve_spec_adaptive_steps", slot="8") == 2
    assert v("pdserve_spec_adaptive_ema_accepted", slot="8") == 1.25 and v("pdserve_spec_adaptive_switches_total") == 7
