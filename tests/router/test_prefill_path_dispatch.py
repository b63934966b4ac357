"""PDDispatcher's prefill path against fake nodes reporting loads and measured rates: remote vs local
under auto, the path policies, prompt tokens in flight, retries deciding again, and the metrics."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.router_options import RouterOptions
from router.contract import DispatchError, FinishEvent
from router.perf import NodePerf
from router.policy import pair_available
from router.prefill_path import PathRule
from tests.router.fake_nodes import Behaviour, FakeNode, cluster, collect, dispatcher, job, run, until

RATE = 10_000.0
LONG_ONLY = PathRule(local_max_tokens=0)  # the estimates alone decide, however short the prompt


def measured(rate: float = RATE, guard: float | None = 0.025, capacity: float = 1000.0, **steps: float) -> dict:
    """A perf report as nodes send it; `steps` are decode step seconds by batch size (b1=..., b8=...)."""
    return {
        "prefill_tokens_per_s": rate,
        "prompt_overhead_s": 0.002,
        "decode_step_s": {k.removeprefix("b"): v for k, v in (steps or {"b1": 0.005, "b8": 0.010}).items()},
        "decode_tokens_per_step": 1.0,
        "decode_capacity_tokens_per_s": capacity,
        "tpot_guard_s": guard,
    }


def prefill(**kw: Any) -> FakeNode:
    return FakeNode("prefill", Behaviour(perf=measured(), **kw))


def local_decode(**kw: Any) -> FakeNode:
    """A decode that runs prompts sent without a bootstrap, idle, with room in its KV cache."""
    return FakeNode("decode", Behaviour(**{"perf": measured(), "local_prefill": True, "max_tokens": 100_000, **kw}))


def sample(metrics: CollectorRegistry, name: str, **labels: str) -> float:
    value = metrics.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_nodes_report_rates_and_older_nodes_report_none() -> None:
    async def main() -> None:
        new = local_decode(waiting_prompt_tokens=700, used_tokens=30, kv_transfer_ms=12.0)
        old = FakeNode("decode")
        async with cluster(prefill(), new, old) as reg:
            n = reg.get(new.address)
            assert n.perf == NodePerf(RATE, 0.002, ((1, 0.005), (8, 0.010)), 1.0, 1000.0, 0.025) and n.local_prefill
            assert (n.waiting_prompt_tokens, n.used_tokens, n.max_tokens) == (700, 30, 100_000)
            assert n.kv_transfer_s == pytest.approx(0.012) and n.loads_at > 0
            o = reg.get(old.address)
            assert o.perf == NodePerf() and not o.local_prefill and o.kv_transfer_s == 0.0
            new.b.perf, new.b.local_prefill = None, None  # restarted as an older build
            await reg.refresh_once()
            assert n.perf == NodePerf() and not n.local_prefill

    run(main())


def test_auto_takes_the_faster_path() -> None:
    async def main() -> None:
        p, d = prefill(waiting_prompt_tokens=1_000_000), local_decode()
        async with cluster(p, d) as reg:
            metrics = CollectorRegistry()
            # every prompt here is a few tokens: without the short-prompt rule, the estimates decide
            disp = dispatcher(reg, metrics_registry=metrics, path_policy="auto", path_rule=LONG_ONLY)
            events = await collect(disp, job())
            # a 100 s prefill queue against an idle decode: the decode runs the prompt itself
            assert not p.requests and not d.requests[0].HasField("disaggregated_params")
            assert isinstance(events[-1], FinishEvent) and events[-1].disaggregated is False
            assert len(events) == 4 and disp.ready()
            # the prefill's queue drained; the decode is at its TPOT budget with 64 running
            p.b.waiting_prompt_tokens = 0
            d.b.running, d.b.perf = 64, measured(guard=0.02, b8=0.01, b64=0.02)
            await reg.refresh_once()
            await collect(disp, job("req-2"))
            assert len(p.requests) == 1 and d.requests[1].HasField("disaggregated_params")
            for path, n in (("remote", 1), ("local", 1), ("colocated", 0)):
                assert sample(metrics, "pdserve_router_prefill_path_total", path=path) == n
            assert sample(metrics, "pdserve_router_prefill_path_decisions_total", reason="faster_local") == 1
            assert sample(metrics, "pdserve_router_prefill_path_decisions_total", reason="decode_at_budget") == 1
            count = "pdserve_router_prefill_path_estimate_seconds_count"
            assert sample(metrics, count, path="remote") == 2 and sample(metrics, count, path="local") == 1
            assert sample(metrics, "pdserve_router_prefill_path_estimate_seconds_sum", path="local") == pytest.approx(
                4 / RATE + 0.002  # its tokens, and the batch's fixed part
            )
            await disp.close()

    run(main())


def test_prompt_tokens_count_in_flight_until_the_first_token() -> None:
    async def main() -> None:
        p, d = prefill(), local_decode(hold_first=asyncio.Event())
        async with cluster(p, d) as reg:
            pn, dn = reg.get(p.address), reg.get(d.address)
            for policy, holder in (("local", dn), ("remote", pn)):
                disp = dispatcher(reg, path_policy=policy)
                d.b.hold_first = asyncio.Event()
                p.b.hold_first = d.b.hold_first  # remote: neither leg answers until released
                task = asyncio.create_task(collect(disp, job(ids=tuple(range(10)))))
                await until(lambda: holder.prompts.total() == 10)
                assert (pn.prompts.total() + dn.prompts.total()) == 10  # only where the prompt runs
                d.b.hold_first.set()
                await task
                assert pn.prompts.total() == dn.prompts.total() == 0
            # an attempt that ends without a first token gives its tokens back too
            d.b.hold_first, d.b.fail_before_first = None, True
            with pytest.raises(DispatchError):
                await collect(dispatcher(reg, path_policy="local", max_attempts=1), job())
            assert dn.prompts.total() == 0 and not dn.prompts.entries

    run(main())


def test_a_retry_decides_again_without_the_failed_decode() -> None:
    async def main() -> None:
        p = prefill(waiting_prompt_tokens=1_000_000)
        fast = local_decode(fail_before_first=True)  # picked first (least load) and taken local
        older = FakeNode("decode", Behaviour(perf=measured(), running=5))  # runs no prompts itself
        async with cluster(p, fast, older) as reg:
            metrics = CollectorRegistry()
            disp = dispatcher(reg, metrics_registry=metrics, path_policy="auto", path_rule=LONG_ONLY)
            events = await collect(disp, job())
            assert isinstance(events[-1], FinishEvent) and events[-1].disaggregated is True
            assert not fast.requests[0].HasField("disaggregated_params")
            assert older.requests[0].HasField("disaggregated_params") and len(p.requests) == 1
            assert reg.get(fast.address).breaker.failures == 1 and reg.get(p.address).breaker.failures == 0
            assert sample(metrics, "pdserve_router_retries_total", reason="decode_failed") == 1
            assert sample(metrics, "pdserve_router_prefill_path_decisions_total", reason="faster_local") == 1
            assert sample(metrics, "pdserve_router_prefill_path_decisions_total", reason="local_refused") == 1

    run(main())


def test_path_policies_without_prefill_nodes_and_without_local_decodes() -> None:
    async def main() -> None:
        d = local_decode()
        async with cluster(d) as reg:
            assert not pair_available(reg) and pair_available(reg, local=True)
            with pytest.raises(DispatchError) as e:  # remote: today's 503 with no pair
                await collect(dispatcher(reg), job())
            assert e.value.status == 503 and not d.requests
            for policy in ("local", "auto"):
                disp = dispatcher(reg, path_policy=policy)
                await collect(disp, job(f"{policy}-1"))
                assert not d.requests[-1].HasField("disaggregated_params") and disp.ready()
        p, older = prefill(), FakeNode("decode", Behaviour(perf=measured()))
        async with cluster(p, older) as reg:
            metrics = CollectorRegistry()
            await collect(dispatcher(reg, metrics_registry=metrics, path_policy="local"), job())
            assert older.requests[0].HasField("disaggregated_params") and len(p.requests) == 1  # paired as before
            assert sample(metrics, "pdserve_router_prefill_path_total", path="remote") == 1
        # no prefill, the decode policy's first choice full: the next decode that has room takes it
        # (least-load always picks the idle one, whose KV holds 5 tokens: no room for 4 + 3)
        full, roomy = local_decode(max_tokens=5), local_decode(running=3)
        async with cluster(full, roomy) as reg:
            disp = dispatcher(reg, path_policy="auto")
            for i in range(4):
                await collect(disp, job(f"full-{i}"))
            assert not full.requests and len(roomy.requests) == 4
        with pytest.raises(ValueError):
            dispatcher(None, path_policy="sometimes")
        assert RouterOptions().pd_prefill_policy == "remote"

    run(main())


def test_sizing_gauges_and_exposition() -> None:
    async def main() -> None:
        p1, p2 = prefill(), FakeNode("prefill", Behaviour(perf=measured(rate=30_000.0)))
        d = local_decode(waiting_prompt_tokens=0)
        async with cluster(p1, p2, d) as reg:
            metrics = CollectorRegistry()
            disp = dispatcher(reg, metrics_registry=metrics, path_policy="auto")
            assert sample(metrics, "pdserve_router_prefill_capacity_tokens_per_second") == 40_000.0
            assert sample(metrics, "pdserve_router_decode_capacity_tokens_per_second") == 1000.0
            assert math.isnan(sample(metrics, "pdserve_router_balanced_prefill_decode_ratio"))  # no demand yet
            await collect(disp, job(ids=tuple(range(100))))  # 100 prompt tokens, 3 output tokens
            prompts = sample(metrics, "pdserve_router_prefill_demand_tokens_per_second")
            outputs = sample(metrics, "pdserve_router_decode_demand_tokens_per_second")
            assert 0 < prompts <= 100 and 0 < outputs <= 3  # per second, over at least one second
            ratio = sample(metrics, "pdserve_router_balanced_prefill_decode_ratio")
            assert ratio == pytest.approx((prompts / 20_000) / (outputs / 1000))
            text = generate_latest(metrics).decode()
            for name in (
                'pdserve_router_prefill_path_total{path="colocated"} 0.0',
                'pdserve_router_prefill_path_decisions_total{reason="kv_headroom"} 0.0',
                "pdserve_router_prefill_path_estimate_seconds_bucket",
                "pdserve_router_prefill_demand_tokens_per_second",
                "pdserve_router_prefill_capacity_tokens_per_second",
                "pdserve_router_decode_demand_tokens_per_second",
                "pdserve_router_decode_capacity_tokens_per_second",
                "pdserve_router_balanced_prefill_decode_ratio",
            ):
                assert name in text, name

    run(main())


def test_each_path_learns_how_its_prompts_compared_with_their_estimates() -> None:
    """A local prompt that took far longer than estimated makes the decode's next local estimates
    longer; a remote one that took less makes the prefill's shorter."""

    async def main() -> None:
        slow = asyncio.Event()
        # 1,000 tokens/s: a 40-token prompt is estimated at 42 ms on an idle decode
        p, d = prefill(), local_decode(perf=measured(rate=1000.0), hold_first=slow)
        async with cluster(p, d) as reg:
            pn, dn = reg.get(p.address), reg.get(d.address)
            metrics = CollectorRegistry()
            disp = dispatcher(reg, metrics_registry=metrics, path_policy="local")
            task = asyncio.create_task(collect(disp, job(ids=tuple(range(40)))))
            await asyncio.sleep(1.0)  # 24x the estimate: observed at the bound, 20x
            slow.set()
            await task
            assert dn.ttft.ratio == pytest.approx(1 + 0.2 * (20 - 1))
            assert dn.ttft.current(dn.ttft.at + 30) == pytest.approx(1 + 0.2 * 19 / 2)  # half-life 30 s
            await reg.refresh_once()  # the router's gauge shows it
            gauge = sample(metrics, "pdserve_router_ttft_estimate_ratio", node=d.address, role="decode")
            assert gauge == pytest.approx(4.8, rel=0.01)
            # remote (the decode now refuses prompts): 200,000 queued tokens at 10,000/s, a 20 s
            # estimate, answered at once
            d.b.hold_first, d.b.local_prefill, p.b.waiting_prompt_tokens = None, False, 200_000
            await reg.refresh_once()
            await collect(dispatcher(reg, path_policy="auto"), job("req-2"))
            # the prefill leg may outlive the decode's stream by a moment (router/attempt.py): its
            # answer, which the calibration reads, can come after the client's last token
            for _ in range(200):
                if pn.ttft.at > 0:
                    break
                await asyncio.sleep(0.01)
            assert pn.ttft.ratio == pytest.approx(1 + 0.2 * (0.5 - 1))  # at the lower bound, 0.5
            await disp.close()

    run(main())


def test_a_node_that_ran_its_first_prompt_reports_its_rate_before_the_next_refresh() -> None:
    """Until a refresh brings a prefill node's first measured rate (or a decode node's first step
    times), every decision treats it as unmeasured: the first prompt's answer (and the request's
    end) makes the router read that node again at once."""

    async def main() -> None:
        unmeasured = {**measured(), "prefill_tokens_per_s": 0.0}
        p, d = prefill(), local_decode()
        p.b.perf = unmeasured
        async with cluster(p, d) as reg:
            disp = dispatcher(reg, path_policy="auto")
            assert reg.get(p.address).perf.prefill_tokens_per_s == 0.0
            d.b.perf = {**measured(), "decode_step_s": {}}  # nor has the decode stepped yet
            await reg.refresh_once()
            p.b.perf, d.b.perf = measured(), measured()  # both measured their batches meanwhile
            await collect(disp, job())
            await until(lambda: reg.get(p.address).perf.prefill_tokens_per_s == RATE)  # no refresh_once
            await until(lambda: bool(reg.get(d.address).perf.decode_step_s))
            await disp.close()

    run(main())


def test_the_router_flags_set_auto_s_targets() -> None:
    """--pd-remote-ttft-target-ms sets the overflow target of decodes whose chunks are forwards of
    their own, --pd-mixed-remote-ttft-target-ms that of decodes that mix them (0 by default: the
    faster path wins); the history rule keeps its defaults."""
    from router.main import path_rule

    rule = path_rule(RouterOptions())
    assert (rule.remote_target_s, rule.mixed_remote_target_s, rule.local_max_tokens) == (0.2, 0.0, 256)
    assert rule.history_target_s == PathRule().history_target_s
    options = RouterOptions(
        pd_remote_ttft_target_ms=350.0, pd_mixed_remote_ttft_target_ms=125.0, pd_local_max_tokens=64
    )
    rule = path_rule(options)
    assert (rule.remote_target_s, rule.mixed_remote_target_s, rule.local_max_tokens) == (0.35, 0.125, 64)
    assert rule.history_target_s == PathRule().history_target_s  # not the remote target
    assert rule.overflow(mixed_chunk=True) == (0.125, 1.0)
