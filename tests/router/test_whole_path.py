"""The whole path on scripted node states and through the dispatcher against fake nodes: a request
runs whole on a prefill node that decodes too when one more would put the decode node's steps past
its TPOT guard, and only then."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from common.sampling import SamplingParams
from router.contract import GenerationJob
from router.nodes import NodeRegistry, NodeSpec, NodeState
from router.perf import NodePerf
from router.policy import RoundRobin
from router.policy import pair_available
from router.prefill_path import DECODE_FULL, NO_DECODE, PATHS, REASONS, runs_whole, select_route, steps_past_guard
from tests.router.fake_nodes import Behaviour, FakeNode, cluster, collect, dispatcher, job, run

GUARD = 0.015  # both nodes' TPOT guard
STEPS = ((1, 0.006), (64, 0.010), (128, 0.014))  # decode step seconds by batch size


def node(role: str, running: int = 0, steps: tuple[tuple[int, float], ...] = STEPS, **kw: Any) -> NodeState:
    perf = NodePerf(prefill_tokens_per_s=40_000.0, decode_step_s=steps, decode_tokens_per_step=1.0, tpot_guard_s=GUARD)
    return NodeState(NodeSpec(role, f"{role[0]}:1"), healthy=True, running=running, perf=perf, **kw)


def whole_prefill(running: int = 0, **kw: Any) -> NodeState:
    """A prefill node that runs requests whole (`--local-decode-tpot-ms`), not yet decoding any."""
    kw.setdefault("steps", ())
    return node("prefill", running, local_decode=True, max_tokens=100_000, **kw)


def past_guard(running: int, steps: tuple[tuple[int, float], ...] = STEPS) -> bool:
    d = node("decode", running=running, steps=steps)
    return steps_past_guard(d, d.perf)


def test_the_decode_is_full_when_one_more_request_steps_past_its_guard() -> None:
    assert not past_guard(100)  # 12.3 ms at 101: room
    assert past_guard(150)  # 15.4 ms at 151, past 128 on its last slope
    assert not past_guard(150, steps=())  # unmeasured: never full
    spec = node("decode", running=150)
    spec.perf = NodePerf(decode_step_s=STEPS, decode_tokens_per_step=2.0, tpot_guard_s=GUARD)
    assert not steps_past_guard(spec, spec.perf)  # two tokens a step: 30 ms a step is within the guard


def test_whole_needs_a_full_decode_and_a_prefill_that_decodes_with_room() -> None:
    full, roomy = node("decode", running=150), node("decode", running=10)
    assert runs_whole(whole_prefill(), full, 1024, 256)
    assert not runs_whole(whole_prefill(), roomy, 1024, 256)  # the decode keeps its requests
    assert not runs_whole(node("prefill"), full, 1024, 256)  # a prefill that refuses whole requests
    assert not runs_whole(whole_prefill(used_tokens=99_000), full, 1024, 256)  # no KV for it
    # an unmeasured prefill is priced on the decode's line: 150 of its own running is past it too
    assert not runs_whole(whole_prefill(running=150), full, 1024, 256)
    # once measured, its own line: a faster one still has room at 150
    assert runs_whole(whole_prefill(running=150, steps=((1, 0.004), (256, 0.012))), full, 1024, 256)


def test_whole_leaves_the_prefill_the_prompt_time_its_demand_needs() -> None:
    """Decoding one request, the prefill's steps are held to its 15 ms guard, of which the step
    (6 ms at one request, on the decode's line) leaves 9 ms for prompts: 0.6 of its 40K tokens/s."""
    full = node("decode", running=150)
    assert runs_whole(whole_prefill(), full, 1024, 256, prompt_demand=16_000.0)
    assert runs_whole(whole_prefill(), full, 1024, 256, prompt_demand=24_000.0)
    assert not runs_whole(whole_prefill(), full, 1024, 256, prompt_demand=24_500.0)
    # at 64 decoding its step takes 10 ms: a third of the guard for prompts, 13.3K tokens/s
    assert not runs_whole(whole_prefill(running=63), full, 1024, 256, prompt_demand=16_000.0)
    # its mixed rate, where measured, is what its prompts run at beside decoding
    mixed = whole_prefill()
    mixed.perf = NodePerf(prefill_tokens_per_s=40_000.0, tpot_guard_s=GUARD, mixed_tokens_per_s=60_000.0)
    assert runs_whole(mixed, full, 1024, 256, prompt_demand=32_000.0)


def route(prefill: NodeState, decode: NodeState, policy: str = "auto", prompt_demand: float = 0.0) -> Any:
    registry = NodeRegistry([])
    registry.states = [prefill, decode]
    job = GenerationJob("r", tuple(range(1024)), SamplingParams(max_new_tokens=256))
    return select_route(registry, RoundRobin(), RoundRobin(), policy, job, prompt_demand=prompt_demand)


def test_auto_routes_whole_to_the_prefill_when_the_decode_is_full() -> None:
    p, full = whole_prefill(), node("decode", running=150)
    r = route(p, full)
    assert (r.path, r.prefill, r.decode) == ("whole", None, p)  # the prefill node streams it alone
    assert r.decision.reason == DECODE_FULL and r.estimate_s() == r.decision.remote_s
    assert route(p, node("decode", running=10)).path == "remote"
    assert route(p, full, "remote").path == "remote"  # the operator's remote policy is kept
    # prompts the prefill could not keep up with while decoding: the pair's usual path instead
    assert route(p, full, prompt_demand=32_000.0).path == "remote"
    assert "whole" in PATHS and DECODE_FULL in REASONS  # metric label values


def perf(guard: float, **steps: float) -> dict:
    """A perf report as nodes send it; `steps` are decode step seconds by batch size (b1=...)."""
    step_s = {k.removeprefix("b"): v for k, v in steps.items()}
    return {"prefill_tokens_per_s": 4e4, "decode_step_s": step_s, "decode_tokens_per_step": 1.0, "tpot_guard_s": guard}


def test_the_dispatcher_sends_a_request_whole_to_the_prefill_while_the_decode_is_full() -> None:
    async def main() -> None:
        p = FakeNode("prefill", Behaviour(perf=perf(GUARD), local_decode=True, max_tokens=100_000))
        d = FakeNode("decode", Behaviour(perf=perf(GUARD, b64=0.010, b128=0.014), running=150))
        async with cluster(p, d) as reg:
            assert reg.get(p.address).local_decode and not reg.get(d.address).local_decode
            metrics = CollectorRegistry()
            disp = dispatcher(reg, metrics_registry=metrics, path_policy="auto")
            await collect(disp, job())
            # the prefill node streams it alone; the decode never hears of it
            assert not d.requests and not p.requests[0].HasField("disaggregated_params")
            d.b.running = 10  # its batch drained: PD again
            await reg.refresh_once()
            await collect(disp, job("req-2"))
            assert len(d.requests) == 1 and p.requests[1].HasField("disaggregated_params")
            get = metrics.get_sample_value
            assert get("pdserve_router_prefill_path_total", {"path": "whole"}) == 1
            assert get("pdserve_router_prefill_path_decisions_total", {"reason": DECODE_FULL}) == 1
            await disp.close()

    run(main())


def test_with_no_decode_a_prefill_that_decodes_serves_requests_whole() -> None:
    """No usable decode node and no colocated one: under auto, a prefill node that decodes serves the
    request alone rather than the router answering 503; under remote, nothing does."""
    registry = NodeRegistry([])
    p = whole_prefill()
    registry.states = [p]
    job = GenerationJob("r", tuple(range(1024)), SamplingParams(max_new_tokens=256))
    r = select_route(registry, RoundRobin(), RoundRobin(), "auto", job)
    assert (r.path, r.prefill, r.decode, r.decision.reason) == ("whole", None, p, NO_DECODE)
    assert select_route(registry, RoundRobin(), RoundRobin(), "remote", job) is None
    assert select_route(registry, RoundRobin(), RoundRobin(), "auto", job, exclude={p.address}) is None
    p.used_tokens = 99_500  # no KV for it
    assert select_route(registry, RoundRobin(), RoundRobin(), "auto", job) is None
    registry.states = [node("prefill")]  # one that refuses whole requests
    assert select_route(registry, RoundRobin(), RoundRobin(), "auto", job) is None
    assert not pair_available(registry, local=True, whole=True)
    registry.states = [whole_prefill()]
    assert pair_available(registry, local=True, whole=True) and not pair_available(registry, local=True)
    assert NO_DECODE in REASONS


def test_the_dispatcher_serves_whole_on_the_prefill_while_no_decode_is_up() -> None:
    async def main() -> None:
        p = FakeNode("prefill", Behaviour(perf=perf(GUARD), local_decode=True, max_tokens=100_000))
        d = FakeNode("decode", Behaviour(perf=perf(GUARD), healthy=False))
        async with cluster(p, d) as reg:
            disp = dispatcher(reg, path_policy="auto")
            assert disp._placeable()
            events = await collect(disp, job())
            assert events and not p.requests[0].HasField("disaggregated_params") and not d.requests
            await disp.close()

    run(main())
