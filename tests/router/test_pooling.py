"""Falling back to colocated execution (router/pooling.py): the tiers' recent load on scripted node
states, when `auto` pools and splits again (hysteresis and dwell), which node a pooled request goes
to, and the dispatcher against fake nodes: pooled, requests run whole on the prefill node or
locally on the decode node, never as a PD pair, until the decode tier has room again."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from common.defaults import check_pd_pooling
from common.sampling import SamplingParams
from router.contract import GenerationJob
from router.nodes import NodeRegistry, NodeSpec, NodeState
from router.perf import NodePerf
from router.policy import LeastLoad
from router.pooling import PoolRule, PoolSwitch, poolable, select_pooled
from router.prefill_path import POOLED, REASONS
from router.sizing import TierBalance, TierLoad, decode_capacity_within_guard
from tests.router.fake_nodes import Behaviour, FakeNode, cluster, collect, dispatcher, job, run

GUARD = 0.015
STEPS = ((1, 0.006), (64, 0.010), (128, 0.014))  # 15 ms at 144 on the last slope


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load(prefill: float, decode: float) -> TierLoad:
    return TierLoad(prefill, decode, 1, 1)


def test_a_decode_nodes_capacity_is_the_largest_batch_its_guard_allows() -> None:
    perf = NodePerf(decode_step_s=STEPS, decode_tokens_per_step=1.0, tpot_guard_s=GUARD)
    assert decode_capacity_within_guard(perf) == pytest.approx(144 / 0.015)
    # speculative: two tokens a step, so a step may take 30 ms; the line reaches it at 384
    spec = NodePerf(decode_step_s=STEPS, decode_tokens_per_step=2.0, tpot_guard_s=GUARD)
    assert decode_capacity_within_guard(spec) == pytest.approx(384 * 2 / 0.030)
    # the node's own figure at its --max-running bounds the extrapolated line
    capped = NodePerf(
        decode_step_s=STEPS, decode_tokens_per_step=1.0, tpot_guard_s=GUARD, decode_capacity_tokens_per_s=9e3
    )
    assert decode_capacity_within_guard(capped) == 9e3
    # no guard: its reported capacity; one request already past the guard: nothing
    assert decode_capacity_within_guard(NodePerf(decode_capacity_tokens_per_s=5e3)) == 5e3
    assert decode_capacity_within_guard(NodePerf(decode_step_s=((1, 0.02),), tpot_guard_s=GUARD)) == 0.0


def node(role: str, **kw: Any) -> NodeState:
    perf = NodePerf(prefill_tokens_per_s=40_000.0, decode_step_s=STEPS, decode_tokens_per_step=1.0, tpot_guard_s=GUARD)
    return NodeState(NodeSpec(role, f"{role[0]}:{kw.pop('n', 1)}"), healthy=True, perf=perf, **kw)


def test_the_recent_load_counts_computed_prompt_tokens_and_every_output() -> None:
    clock = Clock()
    registry = NodeRegistry([])
    registry.states = [node("prefill"), node("decode")]
    balance = TierBalance(registry, clock)
    assert balance.recent_load().decode == 0.0
    for _ in range(10):  # 5 s of 2 requests a second: 1,000-token prompts, 300 of them cached
        balance.add_prompt(1000, cached=300)
        balance.add_output(800)
        clock.now += 0.5
    got = balance.recent_load()
    assert got.prefill == pytest.approx(7000 / 5 / 40_000)
    assert got.decode == pytest.approx(8000 / 5 / (144 / 0.015))
    assert got.pooled == pytest.approx((got.prefill + got.decode) / 2)
    assert got.decode_batch == 0.0  # nothing running
    registry.states[1].running = 72
    assert balance.recent_load().decode_batch == pytest.approx(72 / 144)
    assert balance.prefill_demand() == pytest.approx(10_000 / 5)  # the 60 s gauge counts every prompt token
    registry.states = [node("decode")]  # no prefill measured: its load is unknown
    assert math.isnan(balance.recent_load().prefill)


def test_pool_when_decode_is_the_bottleneck_and_pooling_relieves_it() -> None:
    rule = PoolRule()
    assert rule.should_pool(load(0.6, 0.9))  # decode-heavy: pooled 0.75 against 0.9
    assert not rule.should_pool(load(0.6, 0.7))  # decode has room
    assert not rule.should_pool(load(0.95, 0.9))  # prompts are the larger load: the split's overflow serves it
    assert not rule.should_pool(load(0.85, 0.9))  # pooled 0.875: too little gain
    assert not rule.should_pool(load(math.nan, 0.9))
    # the running batch says what the rates' window has not caught up with yet
    assert rule.should_pool(TierLoad(0.3, 0.4, 1, 1, decode_batch=0.9))
    assert not rule.should_pool(TierLoad(0.3, 0.4, 1, 1, decode_batch=0.5))
    assert rule.should_pool(TierLoad(0.3, math.nan, 1, 1, decode_batch=0.9))
    assert rule.should_split(load(0.3, 0.55))  # decode has room again
    assert rule.should_split(load(1.2, 1.1))  # prompts grew past it
    assert not rule.should_split(load(0.6, 0.75))  # between the thresholds: stays
    assert not rule.should_split(load(0.6, math.nan))
    # pooled, the decode's own batch is its share only: the rates decide
    assert rule.should_split(TierLoad(0.3, 0.5, 1, 1, decode_batch=0.95))
    with pytest.raises(ValueError):
        PoolRule(enter_decode_load=0.5, leave_decode_load=0.6)


def test_auto_pools_and_splits_with_a_dwell_and_other_modes_hold() -> None:
    clock = Clock()
    switch = PoolSwitch("auto", PoolRule(dwell_s=10.0), clock)
    assert not switch.update(load(0.6, 0.7), True) and not switch.pooled
    assert switch.update(load(0.6, 0.9), True) and switch.pooled
    clock.now += 5
    assert not switch.update(load(0.2, 0.3), True) and switch.pooled  # within the dwell: holds
    clock.now += 5
    assert switch.update(load(0.2, 0.3), True) and not switch.pooled
    clock.now += 1
    assert not switch.update(load(0.6, 0.9), True)  # the dwell holds the split too
    clock.now += 10
    assert switch.update(load(0.6, 0.9), True) and switch.pooled
    assert switch.update(load(0.6, 0.9), False) and not switch.pooled  # no node can serve pooled: at once
    always, off = PoolSwitch("always", clock=clock), PoolSwitch("off", clock=clock)
    assert always.update(load(0.1, 0.1), True) and always.pooled
    assert not off.update(load(0.6, 5.0), True) and not off.pooled
    with pytest.raises(ValueError, match="pd-pooling"):
        PoolSwitch("sometimes")


def test_the_flags_refuse_pooling_without_the_auto_path_policy() -> None:
    assert check_pd_pooling("auto", "auto") == "auto" and check_pd_pooling("off", "remote") == "off"
    with pytest.raises(ValueError, match="needs --pd-prefill-policy auto"):
        check_pd_pooling("always", "remote")
    with pytest.raises(ValueError, match="must be one of"):
        check_pd_pooling("yes", "auto")


def pooled_route(*nodes: NodeState, max_new: int = 256) -> Any:
    registry = NodeRegistry([])
    registry.states = list(nodes)
    job_ = GenerationJob("r", tuple(range(1024)), SamplingParams(max_new_tokens=max_new))
    return select_pooled(registry, LeastLoad(), job_)


def test_a_pooled_request_goes_to_the_lighter_node_that_can_hold_it() -> None:
    p = node("prefill", local_decode=True, max_tokens=100_000, running=10)
    d = node("decode", local_prefill=True, max_tokens=100_000, running=3)
    r = pooled_route(p, d)
    assert (r.path, r.prefill, r.decode, r.decision.reason) == ("local", None, d, POOLED)
    d.running = 30
    r = pooled_route(p, d)
    assert (r.path, r.prefill, r.decode) == ("whole", None, p)
    p.used_tokens = 99_500  # no KV for prompt + output there: the decode takes it
    assert pooled_route(p, d).decode is d
    d.used_tokens = 99_500
    assert pooled_route(p, d) is None  # neither: the caller routes it as split
    # nodes that cannot serve alone are not in the pool
    assert pooled_route(node("prefill", max_tokens=100_000), node("decode", max_tokens=100_000)) is None
    registry = NodeRegistry([])
    registry.states = [p, node("decode", local_prefill=True)]
    assert poolable(registry)
    registry.states = [node("prefill"), node("decode", local_prefill=True)]
    assert not poolable(registry)
    assert POOLED in REASONS  # a metric label value


def test_the_dispatcher_pools_under_decode_load_and_splits_again() -> None:
    async def main() -> None:
        report = {"prefill_tokens_per_s": 4e4, "decode_step_s": {"1": 0.006, "128": 0.014}, "tpot_guard_s": GUARD}
        report["decode_tokens_per_step"] = 1.0
        p = FakeNode("prefill", Behaviour(perf=report, local_decode=True, max_tokens=100_000))
        d = FakeNode("decode", Behaviour(perf=report, local_prefill=True, max_tokens=100_000, running=4))
        async with cluster(p, d) as reg:
            metrics = CollectorRegistry()
            disp = dispatcher(reg, metrics_registry=metrics, path_policy="auto", pooling="auto")
            disp.pool.rule = PoolRule(dwell_s=0.0)
            get = metrics.get_sample_value
            await collect(disp, job())
            assert p.requests[0].HasField("disaggregated_params")  # split: a PD pair
            # decode-heavy traffic: 60K output tokens in a second against ~9.6K/s within the guard
            for _ in range(10):
                disp.balance.add_output(6000)
                disp.balance.add_prompt(2000)
            disp.update_pool()
            assert disp.pool.pooled and get("pdserve_router_pd_pooled") == 1.0
            assert get("pdserve_router_pd_pool_switches_total", {"to": "pooled"}) == 1
            assert get("pdserve_router_tier_load", {"tier": "decode"}) > 1.0
            await collect(disp, job("req-2"))  # the lighter node: the prefill, 0 running
            assert len(d.requests) == 1 and not p.requests[1].HasField("disaggregated_params")
            p.b.running = 9
            await reg.refresh_once()
            await collect(disp, job("req-3"))  # now the decode, alone
            assert len(p.requests) == 2 and not d.requests[1].HasField("disaggregated_params")
            assert get("pdserve_router_prefill_path_decisions_total", {"reason": POOLED}) == 2
            disp.balance.recent_outputs = type(disp.balance.recent_outputs)(5.0)  # the traffic went
            disp.update_pool()
            assert not disp.pool.pooled and get("pdserve_router_pd_pool_switches_total", {"to": "split"}) == 1
            await collect(disp, job("req-4"))
            assert p.requests[-1].HasField("disaggregated_params")  # a pair again
            await disp.close()

    run(main())
