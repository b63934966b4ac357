"""Falling back to colocated execution (router/pooling.py): the tiers' recent load on scripted node
states, when `auto` pools and splits again (hysteresis and dwell), which node a pooled request goes
to, and the dispatcher against fake nodes: pooled, requests run whole on the prefill node or
locally on the decode node, never as a PD pair, until the decode tier has room again."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from common.defaults import check_pd_pooling
from common.sampling import SamplingParams
from router.contract import GenerationJob
from router.nodes import NodeRegistry, NodeSpec, NodeState
from router.perf import NodePerf
from router.policy import LeastLoad
from router.pooling import PoolMetrics, PoolRule, PoolSwitch, poolable, select_pooled
from router.prefill_path import POOLED, REASONS
from router.sizing import TierBalance
from router.tier_load import StepLine, TierLoad
from tests.router.fake_nodes import Behaviour, FakeNode, cluster, collect, dispatcher, job, run

GUARD = 0.015
STEPS = ((1, 0.006), (64, 0.010), (128, 0.014))  # decode step seconds by batch size


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def load(prefill: float, decode: float) -> TierLoad:
    """Split loads, pooled their mean (a line with no fixed part)."""
    return TierLoad(prefill, decode, (prefill + decode) / 2)


def node(role: str, **kw: Any) -> NodeState:
    perf = NodePerf(prefill_tokens_per_s=40_000.0, decode_step_s=STEPS, decode_tokens_per_step=1.0, tpot_guard_s=GUARD)
    return NodeState(NodeSpec(role, f"{role[0]}:{kw.pop('n', 1)}"), healthy=True, perf=perf, **kw)


def test_a_step_is_its_fixed_part_over_what_the_rates_leave() -> None:
    line = StepLine.of(node("decode").perf)
    assert line is not None
    per_request = (0.014 - 0.006) / 127
    assert (line.fixed_s, line.per_request_s) == (0.006, pytest.approx(per_request))
    assert (line.per_prompt_token_s, line.cycle_s) == (1 / 40_000, GUARD)
    # 8K output tokens/s: B = 8000 x step requests, so step = 6 ms / (1 - per_request x 8000)
    assert line.loaded_step_s(8000) == pytest.approx(0.006 / (1 - per_request * 8000))
    assert line.loaded_step_s(8000, 10_000) == pytest.approx(0.006 / (1 - per_request * 8000 - 0.25))
    assert line.loaded_step_s(20_000) == math.inf  # no batch keeps up
    # speculative: two tokens a request per step halve the batch and double the cycle
    spec = StepLine.of(NodePerf(decode_step_s=STEPS, decode_tokens_per_step=2.0, tpot_guard_s=GUARD))
    assert spec is not None and spec.cycle_s == 2 * GUARD
    assert spec.loaded_step_s(8000) == pytest.approx(0.006 / (1 - per_request * 4000))
    assert StepLine.of(NodePerf(decode_step_s=STEPS)) is None  # no guard: no budget to price against


def test_the_recent_load_prices_computed_prompts_and_every_output_on_the_step_line() -> None:
    clock = Clock()
    registry = NodeRegistry([])
    registry.states = [node("prefill"), node("decode")]
    balance = TierBalance(registry, clock)
    idle = balance.recent_load()
    assert (idle.prefill, idle.decode_batch) == (0.0, pytest.approx(0.006 / GUARD))
    for _ in range(10):  # 5 s of 2 requests a second: 1,000-token prompts, 300 of them cached
        balance.add_prompt(1000, cached=300)
        balance.add_output(800)
        clock.now += 0.5
    got, line = balance.recent_load(), StepLine.of(node("decode").perf)
    assert line is not None
    assert got.prefill == pytest.approx(7000 / 5 / 40_000)
    assert got.decode == pytest.approx(line.loaded_step_s(1600) / GUARD)  # one decode node emits all
    assert got.pooled == pytest.approx(line.loaded_step_s(800, 700) / GUARD)  # two nodes, half of each
    assert balance.prefill_demand() == pytest.approx(10_000 / 5)  # the 60 s gauge counts every prompt token
    registry.states[1].running = 72  # the batch it runs now: 10.5 ms of the 15 ms guard
    assert balance.recent_load().decode_batch == pytest.approx(0.0105 / GUARD)
    registry.states = [node("decode")]  # no prefill measured: its load is unknown
    assert math.isnan(balance.recent_load().prefill)
    registry.states = [node("prefill")]  # no decode line: nothing to price on
    assert math.isnan(balance.recent_load().decode)


def test_prompts_a_decode_node_computes_weigh_on_its_shown_load_not_the_rules() -> None:
    """The twenty-seventh goodput run: the rule's decode load read 0.33-0.63 while the decode node's
    local prompts held its TPOT at 20-29 ms. `decode_local` prices them into its steps; the rule
    still decides on `decode`."""
    clock = Clock()
    registry = NodeRegistry([])
    registry.states = [node("prefill"), node("decode")]
    balance = TierBalance(registry, clock)
    for _ in range(10):  # 5 s: 2 prompts a second of 1,000 tokens, one of them local, 300 cached
        balance.add_prompt(1000, cached=300, on_decode=True)
        balance.add_prompt(1000)
        balance.add_output(800)
        clock.now += 0.5
    got, line = balance.recent_load(), StepLine.of(node("decode").perf)
    assert line is not None and got.line == line
    assert got.decode == pytest.approx(line.loaded_step_s(1600) / GUARD)
    assert got.decode_local == pytest.approx(line.loaded_step_s(1600, 700 * 10 / 5) / GUARD)
    assert got.decode_local > got.decode
    metrics = CollectorRegistry()
    PoolMetrics(metrics).record(False, False, got)
    assert metrics.get_sample_value("pdserve_router_tier_load", {"tier": "decode_local"}) == got.decode_local
    assert metrics.get_sample_value("pdserve_router_decode_step_line_seconds", {"part": "cycle"}) == GUARD
    assert metrics.get_sample_value("pdserve_router_decode_step_line_seconds", {"part": "fixed"}) == 0.006
    PoolMetrics(unknown := CollectorRegistry()).record(False, False, TierLoad(math.nan, math.nan, math.nan))
    assert math.isnan(unknown.get_sample_value("pdserve_router_decode_step_line_seconds", {"part": "fixed"}) or 0.0)


def test_a_switch_logs_the_loads_and_the_line_it_was_decided_on(caplog: pytest.LogCaptureFixture) -> None:
    """Each switch's log line has what tuning the rule needs: the tiers' loads and the step line,
    with how far the line was measured (beyond that batch it is extrapolated)."""
    line = StepLine.of(node("decode").perf)
    assert line is not None and line.largest_batch == node("decode").perf.decode_step_s[-1][0]
    metrics = PoolMetrics(CollectorRegistry())
    with caplog.at_level("INFO", logger="router.pooling"):
        metrics.record(True, False, TierLoad(0.5, 1.2, 0.7, line=line))  # no switch: nothing logged
        assert not caplog.records
        metrics.record(True, True, TierLoad(0.5, 1.2, 0.7, line=line))
        metrics.record(False, True, TierLoad(0.5, math.nan, math.nan))
    pooled, split = (r.getMessage() for r in caplog.records)
    assert pooled.startswith("pd pooling: pooled on loads prefill 0.50 decode 1.20") and "pooled 0.70" in pooled
    assert f"measured to batch {line.largest_batch}" in pooled and "fixed 6.00 ms" in pooled
    assert split.startswith("pd pooling: split on") and split.endswith("no step line")


def test_pool_when_decode_is_the_bottleneck_and_pooling_relieves_it() -> None:
    rule = PoolRule()
    assert rule.should_pool(TierLoad(0.6, 1.1, 0.8))
    assert not rule.should_pool(TierLoad(0.6, 0.9, 0.5))  # decode within its budget: the split isolates it
    assert not rule.should_pool(TierLoad(1.2, 1.1, 0.5))  # prompts are the larger load: the split's overflow
    assert not rule.should_pool(TierLoad(0.6, 1.1, 1.06))  # too little gain
    assert not rule.should_pool(TierLoad(math.nan, 1.1, 0.7))
    assert not rule.should_pool(TierLoad(0.6, 1.1, math.inf))  # pooled would not keep up either
    assert rule.should_pool(TierLoad(0.6, math.inf, 2.0))  # the split cannot keep up, pooled can nearly
    # the batch it runs now does not decide entry: the output rate does
    assert not rule.should_pool(TierLoad(0.3, 0.8, 0.5, decode_batch=1.1))
    assert rule.should_pool(TierLoad(0.3, 1.1, 0.5, decode_batch=0.5))
    assert not rule.should_pool(TierLoad(0.97, 0.59, 0.74, decode_batch=1.2))
    assert rule.should_split(TierLoad(0.3, 0.7, 0.4))  # decode has room again
    assert rule.should_split(TierLoad(1.2, 1.1, 0.9))  # prompts grew past it
    assert rule.should_split(TierLoad(0.6, 1.1, 1.15))  # pooling no longer lightens the busiest tier
    assert not rule.should_split(TierLoad(0.6, 0.9, 0.6))  # between the thresholds: stays
    assert not rule.should_split(TierLoad(0.6, math.nan, 0.5))
    # pooled, the decode's own batch is its share only: the rates decide
    assert not rule.should_split(TierLoad(0.3, 0.8, 0.5, decode_batch=0.3))
    with pytest.raises(ValueError):
        PoolRule(enter_decode_load=0.5, leave_decode_load=0.6)


def test_no_pooling_on_a_load_priced_far_past_the_measured_batches() -> None:
    """The twenty-eighth goodput run pooled only at or near a deployment's first points: a cold
    line (measured only on a few requests) does not pool on a load priced past twice its largest
    batch; a line measured on real batches is trusted past them, even to an infinite batch."""
    cold_perf = NodePerf(decode_step_s=((1, 0.006), (4, 0.0062)), decode_tokens_per_step=1.0, tpot_guard_s=GUARD)
    cold, warm = StepLine.of(cold_perf), StepLine.of(node("decode").perf)
    assert cold is not None and warm is not None and (cold.largest_batch, warm.largest_batch) == (4, 128)
    rule = PoolRule()
    assert rule.should_pool(TierLoad(0.6, 1.1, 0.8, line=cold, split_batch=8))
    assert not rule.should_pool(TierLoad(0.6, 1.1, 0.8, line=cold, split_batch=9))
    assert not rule.should_pool(TierLoad(0.6, math.inf, 0.8, line=cold, split_batch=math.inf))
    assert rule.should_pool(TierLoad(0.6, 1.1, 0.8, line=warm, split_batch=1000))
    assert rule.should_pool(TierLoad(0.6, math.inf, 0.8, line=warm, split_batch=math.inf))
    assert rule.should_pool(TierLoad(0.6, 1.1, 0.8, line=cold))  # batch unknown: the loads decide
    assert PoolRule(max_extrapolation=3.0).should_pool(TierLoad(0.6, 1.1, 0.8, line=cold, split_batch=9))
    assert PoolRule(trusted_batch=4).should_pool(TierLoad(0.6, 1.1, 0.8, line=cold, split_batch=9))
    with pytest.raises(ValueError, match="max_extrapolation"):
        PoolRule(max_extrapolation=0.5)
    line = warm
    # the batch is the split's: the decode node's share of the output rate times its step
    clock = Clock()
    registry = NodeRegistry([])
    registry.states = [node("prefill"), node("decode")]
    balance = TierBalance(registry, clock)
    for _ in range(10):
        balance.add_output(5000)
        clock.now += 0.5
    got = balance.recent_load()
    assert got.split_batch == pytest.approx(10_000 * line.loaded_step_s(10_000) / line.tokens_per_step)


def test_loads_that_pool_never_split_again_at_once() -> None:
    """The enter rule implies the leave rule's negation on the same loads: any switch back needs the
    load itself to change."""
    rule = PoolRule()
    rng = random.Random(7)
    pooled = 0
    for _ in range(20_000):
        prefill, decode, batch = (rng.choice([math.nan, rng.uniform(0, 1.5)]) for _ in range(3))
        load = TierLoad(prefill, decode, rng.uniform(0, 1.5), decode_batch=batch)
        if rule.should_pool(load):
            pooled += 1
            assert not rule.should_split(load), load
    assert pooled > 100


def test_auto_pools_and_splits_with_a_dwell_and_other_modes_hold() -> None:
    clock = Clock()
    switch = PoolSwitch("auto", PoolRule(dwell_s=10.0), clock)
    assert not switch.update(load(0.6, 0.9), True) and not switch.pooled
    assert switch.update(load(0.6, 1.1), True) and switch.pooled
    clock.now += 5
    assert not switch.update(load(0.2, 0.3), True) and switch.pooled  # within the dwell: holds
    clock.now += 5
    assert switch.update(load(0.2, 0.3), True) and not switch.pooled
    clock.now += 1
    assert not switch.update(load(0.6, 1.1), True)  # the dwell holds the split too
    clock.now += 10
    assert switch.update(load(0.6, 1.1), True) and switch.pooled
    assert switch.update(load(0.6, 0.9), False) and not switch.pooled  # no node can serve pooled: at once
    # between refreshes, routing re-decides at most every quarter second
    assert not switch.due()
    clock.now += 0.25
    assert switch.due()
    always, off = PoolSwitch("always", clock=clock), PoolSwitch("off", clock=clock)
    assert always.due() and not off.due()
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
            # decode-heavy traffic: 10K output tokens/s put one decode node's step past its 15 ms
            # guard (16.2 ms); shared with the prefill node beside 5K prompt tokens/s, 9.6 ms
            for _ in range(10):
                disp.balance.add_output(1000)
                disp.balance.add_prompt(500)
            disp.update_pool()
            assert disp.pool.pooled and get("pdserve_router_pd_pooled") == 1.0
            assert get("pdserve_router_pd_pool_switches_total", {"to": "pooled"}) == 1
            assert get("pdserve_router_tier_load", {"tier": "decode"}) > 1.0
            await collect(disp, job("req-2"))  # the lighter node: the prefill, 0 running
            assert len(d.requests) == 1 and not p.requests[1].HasField("disaggregated_params")
            p.b.running = 9
            await reg.refresh_once()
            local_before = disp.balance.recent_local_prompts.per_second()
            await collect(disp, job("req-3"))  # now the decode, alone
            assert len(p.requests) == 2 and not d.requests[1].HasField("disaggregated_params")
            assert disp.balance.recent_local_prompts.per_second() > local_before  # its prompt, on a decode node
            assert get("pdserve_router_prefill_path_decisions_total", {"reason": POOLED}) == 2
            disp.balance.recent_outputs = type(disp.balance.recent_outputs)(5.0)  # the traffic went
            disp.update_pool()
            assert not disp.pool.pooled and get("pdserve_router_pd_pool_switches_total", {"to": "split"}) == 1
            await collect(disp, job("req-4"))
            assert p.requests[-1].HasField("disaggregated_params")  # a pair again
            await disp.close()

    run(main())


def test_nodes_needed_keep_each_decode_step_within_its_guard() -> None:
    """A decode node on STEPS with a 15 ms guard emits (1 - 6/15) / per_request tokens/s within it:
    about 9.5K; prompts need their rate over a prefill node's measured 40K tokens/s."""
    from router.tier_load import nodes_needed

    line = StepLine.of(node("decode").perf)
    assert line is not None
    per_node = (1 - 0.006 / GUARD) / ((0.014 - 0.006) / 127)
    assert line.tokens_within_guard() == pytest.approx(per_node)
    # the busiest step at that rate is the guard itself
    assert line.loaded_step_s(per_node) == pytest.approx(GUARD)
    prefill, decode = nodes_needed([node("prefill")], [node("decode")], 60_000.0, 2 * per_node)
    assert (prefill, decode) == (pytest.approx(1.5), pytest.approx(2.0))
    assert nodes_needed([node("prefill")], [node("decode")], 0.0, 0.0) == (0.0, 0.0)
    flat = node("decode")
    flat.perf = NodePerf(decode_step_s=((1, 0.006),), decode_tokens_per_step=1.0, tpot_guard_s=GUARD)
    assert math.isnan(nodes_needed([], [flat], 0.0, 1000.0)[1])  # one batch size: its growth unmeasured
    flat.perf = NodePerf(
        decode_step_s=((1, 0.006),), decode_tokens_per_step=1.0, tpot_guard_s=GUARD, decode_capacity_tokens_per_s=4e3
    )
    assert nodes_needed([], [flat], 0.0, 1000.0)[1] == 0.25  # until then, its figure at --max-running
    slow = node("decode")
    slow.perf = NodePerf(decode_step_s=((1, 0.02), (8, 0.03)), decode_tokens_per_step=1.0, tpot_guard_s=GUARD)
    assert nodes_needed([], [slow], 0.0, 1000.0)[1] == math.inf  # no step meets its guard
    assert math.isnan(nodes_needed([], [slow], 10.0, 0.0)[0])  # no prefill measured
