"""Router node side: node lists, breaker, policies, and PDDispatcher against fake gRPC nodes
(retries, cancellation, pairing, readiness, colocated fallback), plus one run on real nodes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from router.breaker import BreakerState, CircuitBreaker
from router.contract import DispatchError, FinishEvent, TokenEvent
from router.attempt import MAX_ROOM, StageTimeouts
from router.nodes import NodeSpec, NodeState, parse_node_lists, resolve_headless
from router.policy import LeastLoad, PrefixAware, RoundRobin, make_policy, select_pair
from tests.router.fake_nodes import Behaviour, FakeNode, cluster, collect, dispatcher, job, run, until

# --- node lists, breaker, policies ---------------------------------------------------------


def test_parse_node_lists() -> None:
    specs = parse_node_lists(
        ["10.0.0.1:30000,8998", "grpc://pf-1:30000 9001", "pf-2:30000"], ["dec-0:30001"], ["colo:30002"]
    )
    assert specs == [
        NodeSpec("prefill", "10.0.0.1:30000", 8998),
        NodeSpec("prefill", "pf-1:30000", 9001),
        NodeSpec("prefill", "pf-2:30000", 8998),
        NodeSpec("decode", "dec-0:30001"),
        NodeSpec("colocated", "colo:30002"),
    ]
    assert specs[1].host == "pf-1" and NodeSpec("prefill", "[::1]:5", 1).host == "::1"
    for bad in (["nohost"], ["h:1,2,3"], []):
        with pytest.raises(ValueError):
            parse_node_lists(bad, ["d:1"], []) if bad else parse_node_lists(["h:1"], ["h:1"])
    assert set(resolve_headless("localhost", 80)) & {"127.0.0.1:80", "[::1]:80"}


def test_breaker_transitions() -> None:
    now = [0.0]
    b = CircuitBreaker(failure_threshold=2, cooldown_s=10.0, clock=lambda: now[0])
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.acquire()
    b.record_success()
    b.record_failure()
    b.record_failure()  # two consecutive failures
    assert b.state is BreakerState.OPEN and not b.available() and not b.acquire()
    now[0] = 10.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.acquire() and not b.acquire()  # exactly one probe
    b.record_failure()  # the probe failed: open again, for another cool-down
    assert b.state is BreakerState.OPEN
    now[0] = 20.0
    assert b.acquire()
    b.release()  # a cancelled probe frees its slot
    assert b.acquire()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.failures == 0


def _node(role: str, addr: str, load: int = 0, protocol: str | None = "A") -> NodeState:
    return NodeState(
        NodeSpec(role, addr, 1 if role == "prefill" else None), healthy=True, running=load, pairing_protocol=protocol
    )


def test_round_robin_order_and_least_load() -> None:
    nodes = [_node("decode", a) for a in ("c:1", "a:1", "b:1")]
    rr = RoundRobin()
    assert [rr.choose(nodes, job()).address for _ in range(4)] == ["a:1", "b:1", "c:1", "a:1"]
    nodes[0].running, nodes[1].running, nodes[2].waiting = 3, 5, 4
    ll = LeastLoad()
    assert ll.choose(nodes, job()).address == "c:1"
    nodes[0].inflight = 2  # our own in-flight requests count too
    assert ll.choose(nodes, job()).address == "b:1"


def test_prefix_aware_is_sticky_and_falls_back() -> None:
    nodes = [_node("prefill", f"p{i}:1") for i in range(4)]
    pa = PrefixAware(prefix_tokens=8, balance_threshold=4)
    base = tuple(range(100, 108))
    owner = pa.choose(nodes, job(ids=base + (1, 2))).address
    assert all(pa.choose(nodes, job(ids=base + (i,) * i)).address == owner for i in range(1, 20))
    owners = {pa.choose(nodes, job(ids=(i,) * 8)).address for i in range(40)}
    assert len(owners) >= 3  # different prefixes spread over the nodes
    # Losing another node leaves this prefix where it was (consistent hashing).
    others = [n for n in nodes if n.address != owner]
    assert pa.choose([n for n in nodes if n is not others[0]], job(ids=base)).address == owner
    # Short prompts, and a sticky node far busier than the lightest, go to least-load.
    for n in others:
        n.running = 1
    assert pa.choose(nodes, job(ids=(1, 2))).address == owner
    next(n for n in nodes if n.address == owner).running = 9
    assert pa.choose(nodes, job(ids=base)).address != owner


def test_pair_selection_never_forms_incompatible_pairs() -> None:
    class Reg:
        def __init__(self, states: list[NodeState]) -> None:
            self.states = states

        def nodes(self, role: str) -> list[NodeState]:
            return [s for s in self.states if s.role == role and s.healthy]

    a, b = _node("prefill", "pa:1", protocol="A"), _node("prefill", "pb:1", protocol="B")
    d = _node("decode", "d:1", protocol="B")
    rr = RoundRobin()
    assert select_pair(Reg([a, d]), rr, rr, job()) is None  # type: ignore[arg-type]
    assert all(select_pair(Reg([a, b, d]), rr, rr, job())[0] is b for _ in range(5))  # type: ignore
    a.pairing_protocol = None  # a node naming no protocol pairs with any (SMG's rule)
    assert select_pair(Reg([a, d]), rr, rr, job()) == (a, d)  # type: ignore[arg-type]
    assert select_pair(Reg([a, d]), rr, rr, job(), exclude={"pa:1"}) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        make_policy("decode", "most_cache")


# --- PDDispatcher against fake nodes -------------------------------------------------------


def test_dispatch_sends_identical_requests_and_streams_decode() -> None:
    async def main() -> None:
        p, d = FakeNode("prefill", bootstrap_port=9123), FakeNode("decode")
        async with cluster(p, d) as reg:
            disp = dispatcher(reg)
            assert disp.model().name == "fake-model" and disp.model().eos_token_ids == (2,)
            events = await collect(
                disp, job(temperature=0.7, top_k=5, seed=42, stop=("x",), logprobs=True, top_logprobs=1)
            )
            assert [e.token_ids for e in events[:-1]] == [(11,), (12,), (13,)]
            assert events[0].logprobs == (-0.5,) and events[0].top_logprobs == (((11, -0.5),),)
            assert events[-1] == FinishEvent("length", 4, 3, None, True)
            (pr,), (dr,) = p.requests, d.requests
            assert pr == dr and pr.request_id == "req-1" and pr.stream
            dp = pr.disaggregated_params
            assert (dp.bootstrap_host, dp.bootstrap_port) == ("127.0.0.1", 9123) and 1 <= dp.bootstrap_room <= MAX_ROOM
            sp = pr.sampling_params
            assert (sp.max_new_tokens, sp.top_k, list(sp.stop)) == (3, 5, ["x"])
            assert sp.custom_params.fields["seed"].number_value == 42 and pr.return_logprob
            assert disp.ready() and not p.aborts and not d.aborts
            await until(lambda: reg.get(p.address).inflight == 0)
            await disp.close()

    run(main())


def test_retry_on_a_new_pair_with_a_new_room_before_the_first_token() -> None:
    async def main() -> None:
        p = FakeNode("prefill")
        bad = FakeNode("decode", Behaviour(fail_before_first=True))
        good = FakeNode("decode", Behaviour(running=5))  # least-load tries the failing one first
        async with cluster(p, bad, good) as reg:
            metrics = CollectorRegistry()
            disp = dispatcher(reg, metrics_registry=metrics)
            events = await collect(disp, job())
            assert isinstance(events[-1], FinishEvent) and len(events) == 4
            assert len(bad.requests) == 1 and len(good.requests) == 1
            first, second = bad.requests[0], good.requests[0]
            assert first.disaggregated_params.bootstrap_room != second.disaggregated_params.bootstrap_room
            assert first.request_id != second.request_id
            assert [r.request_id for r in p.requests] == [first.request_id, second.request_id]
            assert metrics.get_sample_value("pdserve_router_retries_total", {"reason": "decode_failed"}) == 1
            assert reg.get(bad.address).breaker.failures == 1 and reg.get(good.address).breaker.failures == 0
            assert first.request_id in bad.aborts and first.request_id in p.aborts  # the failed pair is aborted

    run(main())


def test_hanging_decode_times_out_and_is_retried() -> None:
    async def main() -> None:
        p = FakeNode("prefill")
        hung = FakeNode("decode", Behaviour(hang_before_first=True))
        good = FakeNode("decode", Behaviour(running=5))
        async with cluster(p, hung, good) as reg:
            # a stopped decode: silent to health checks too, and its prefill never gets to write
            hung.b.silent = True
            timeouts = StageTimeouts(prefill_timeout=5, first_token_timeout=0.5, inter_token_timeout=5, abort_timeout=2)
            events = await collect(dispatcher(reg, timeouts=timeouts), job())
            assert isinstance(events[-1], FinishEvent) and len(good.requests) == 1
            await until(lambda: bool(hung.cancelled))

    run(main())


def test_no_retry_after_the_first_token() -> None:
    async def main() -> None:
        p = FakeNode("prefill")
        flaky = FakeNode("decode", Behaviour(fail_after=1))
        spare = FakeNode("decode", Behaviour(running=5))
        async with cluster(p, flaky, spare) as reg:
            seen: list = []
            with pytest.raises(DispatchError) as e:
                async for ev in dispatcher(reg).generate(job()):
                    seen.append(ev)
            assert e.value.before_first_token is False and e.value.status == 502
            assert seen == [TokenEvent((11,))] and not spare.requests

    run(main())


def test_a_mid_stream_failure_is_one_warning_naming_the_request_the_nodes_and_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        p, flaky = FakeNode("prefill"), FakeNode("decode", Behaviour(fail_after=1))
        async with cluster(p, flaky) as reg:
            with caplog.at_level(logging.WARNING, logger="router"), pytest.raises(DispatchError):
                await collect(dispatcher(reg), job("req-mid"))
            lines = [r for r in caplog.records if "mid-stream" in r.getMessage()]
            assert len(lines) == 1 and lines[0].levelno == logging.WARNING, caplog.text
            message = lines[0].getMessage()
            assert "req-mid" in message and p.address in message and flaky.address in message, message
            assert "decode_failed" in message and "UNAVAILABLE" in message, message

    run(main())


def test_a_decode_silent_past_the_inter_token_timeout_fails_the_stream_and_is_cancelled() -> None:
    """After its first token a decode stream is read under a plain timeout (no task raced against
    the prefill leg, which has answered): a decode gone silent mid-stream still ends the stream
    within inter_token_timeout, with a stage timeout, and its RPC is cancelled."""

    async def main() -> None:
        p, d = FakeNode("prefill"), FakeNode("decode", Behaviour(hang_after=1))
        async with cluster(p, d) as reg:
            timeouts = StageTimeouts(prefill_timeout=5, first_token_timeout=5, inter_token_timeout=0.3, abort_timeout=2)
            events: list[TokenEvent | FinishEvent] = []
            start = time.monotonic()
            with pytest.raises(DispatchError, match="no decode message within 0.3 s"):
                async for event in dispatcher(reg, timeouts=timeouts).generate(job("quiet")):
                    events.append(event)
            assert events == [TokenEvent((11,))] and time.monotonic() - start < 3.0
            await until(lambda: "quiet" in d.cancelled)

    run(main())


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_cancellation_aborts_both_legs(how: str) -> None:
    async def main() -> None:
        p, d = FakeNode("prefill"), FakeNode("decode", Behaviour(hang_after=1))
        async with cluster(p, d) as reg:
            disp = dispatcher(reg)
            gen = disp.generate(job("gone"))
            assert await gen.__anext__() == TokenEvent((11,))
            if how == "aclose":
                await gen.aclose()
            else:
                task = asyncio.ensure_future(gen.__anext__())
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await until(lambda: "gone" in p.aborts and "gone" in d.aborts)
            await until(lambda: "gone" in d.cancelled)
            node = reg.get(d.address)
            assert node.inflight == 0 and node.breaker.failures == 0  # a cancel is no node failure

    run(main())


def test_prefill_failure_cancels_the_decode_leg() -> None:
    async def main() -> None:
        p = FakeNode("prefill", Behaviour(fail_before_first=True))
        d = FakeNode("decode", Behaviour(hang_before_first=True))
        async with cluster(p, d) as reg:
            start = time.monotonic()
            with pytest.raises(DispatchError) as e:
                await collect(dispatcher(reg, max_attempts=1), job("pf"))
            assert e.value.status == 502 and e.value.code == "prefill_failed" and e.value.before_first_token
            assert time.monotonic() - start < 2.0
            await until(lambda: "pf" in d.cancelled and "pf" in d.aborts)
            assert reg.get(p.address).breaker.failures == 1 and reg.get(d.address).breaker.failures == 0

    run(main())


def test_bad_request_is_not_retried() -> None:
    async def main() -> None:
        p = FakeNode("prefill")
        d1 = FakeNode("decode", Behaviour(fail_before_first=True, status=grpc.StatusCode.INVALID_ARGUMENT))
        d2 = FakeNode("decode", Behaviour(running=5))
        async with cluster(p, d1, d2) as reg:
            with pytest.raises(DispatchError) as e:
                await collect(dispatcher(reg), job())
            assert e.value.status == 400 and not d2.requests

    run(main())


def test_incompatible_pairs_are_never_formed_and_no_pair_is_503() -> None:
    async def main() -> None:
        pa = FakeNode("prefill", Behaviour(pairing_protocol="A"))
        d = FakeNode("decode", Behaviour(pairing_protocol="B"))
        async with cluster(pa, d) as reg:
            with pytest.raises(DispatchError) as e:
                await collect(dispatcher(reg), job())
            assert (e.value.status, e.value.code, e.value.retry_after_s) == (503, "no_available_pair", 1.0)
            assert not pa.requests and not d.requests
        pb_ = FakeNode("prefill", Behaviour(pairing_protocol="B"))
        pa2, d2 = (
            FakeNode("prefill", Behaviour(pairing_protocol="A")),
            FakeNode("decode", Behaviour(pairing_protocol="B")),
        )
        async with cluster(pa2, pb_, d2) as reg:
            disp = dispatcher(reg)
            for i in range(4):
                await collect(disp, job(f"r{i}"))
            assert not pa2.requests and len(pb_.requests) == 4
        # A node serving the wrong role is a config error: it gets no traffic.
        wrong = FakeNode("prefill", Behaviour(mode="decode"))
        d3 = FakeNode("decode")
        async with cluster(wrong, d3) as reg:
            assert not reg.get(wrong.address).healthy and "disaggregation_mode" in reg.get(wrong.address).error
            with pytest.raises(DispatchError):
                await collect(dispatcher(reg), job())

    run(main())


def test_open_breaker_skips_the_node() -> None:
    async def main() -> None:
        p = FakeNode("prefill")
        bad = FakeNode("decode", Behaviour(fail_before_first=True))
        async with cluster(p, bad) as reg:
            reg.get(bad.address).breaker = CircuitBreaker(failure_threshold=2, cooldown_s=60)
            metrics = CollectorRegistry()
            disp = dispatcher(reg, max_attempts=1, metrics_registry=metrics)
            for _ in range(2):
                with pytest.raises(DispatchError) as e:
                    await collect(disp, job())
                assert e.value.status == 502
            with pytest.raises(DispatchError) as e:
                await collect(disp, job())
            assert e.value.code == "no_available_pair" and len(bad.requests) == 2
            assert (
                metrics.get_sample_value("pdserve_router_breaker_state", {"node": bad.address, "role": "decode"}) == 1
            )  # open

    run(main())


def test_ready_after_probe_and_auto_probe() -> None:
    async def main() -> None:
        p, d = FakeNode("prefill"), FakeNode("decode")
        async with cluster(p, d, refresh=False) as reg:
            disp = dispatcher(reg)
            assert not disp.ready() and not await disp.probe()  # nothing known yet: no pair
            await reg.refresh_once()
            assert not disp.ready()
            assert await disp.probe() and disp.ready()
            assert d.requests[-1].sampling_params.max_new_tokens == 1
            auto = dispatcher(reg, auto_probe=True)
            assert not auto.ready()
            await reg.refresh_once()  # the refresh hook starts a probe
            await until(auto.ready)
            await auto.close()

    run(main())


def test_colocated_fallback() -> None:
    async def main() -> None:
        colo = FakeNode("colocated")
        d = FakeNode("decode")  # a decode with no prefill is no pair
        async with cluster(colo, d) as reg:
            disp = dispatcher(reg)
            events = await collect(disp, job())
            assert events[-1].disaggregated is False and len(events) == 4
            assert not colo.requests[0].HasField("disaggregated_params") and not d.requests
            assert disp.ready()
        p, d2, colo2 = FakeNode("prefill"), FakeNode("decode"), FakeNode("colocated")
        async with cluster(p, d2, colo2) as reg:
            events = await collect(dispatcher(reg), job())
            assert events[-1].disaggregated is True and not colo2.requests

    run(main())


def test_registry_background_refresh_marks_nodes_down_and_up() -> None:
    async def main() -> None:
        p, d = FakeNode("prefill"), FakeNode("decode")
        async with cluster(p, d, refresh=False) as reg:
            reg.refresh_interval = 0.05
            await reg.start()
            assert [n.address for n in reg.nodes("decode")] == [d.address]
            d.b.healthy = False
            await until(lambda: not reg.nodes("decode"))
            d.b.healthy, d.b.running = True, 7
            await until(lambda: bool(reg.nodes("decode")) and reg.nodes("decode")[0].load == 7)

    run(main())


# --- real nodes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_dispatch_against_real_prefill_and_decode(tiny_llama_dir: Any) -> None:
    from engine.kv_transfer import nixl_available

    if not nixl_available():
        pytest.skip("nixl-cu13 is not installed")
    from fixtures.pdkit import pd_generate, request, start_pair, stub

    ids = (5, 17, 42, 7, 99, 3, 11, 250)
    prefill, decode = start_pair(str(tiny_llama_dir))
    try:
        specs = parse_node_lists(
            [f"127.0.0.1:{prefill.ports['scheduler']},{prefill.ports['bootstrap']}"],
            [f"127.0.0.1:{decode.ports['scheduler']}"],
        )

        async def main() -> list:
            from router.nodes import NodeRegistry

            reg = NodeRegistry(specs, rpc_timeout_s=5.0)
            try:
                await reg.refresh_once()
                assert len(reg.nodes("prefill")) == 1 and len(reg.nodes("decode")) == 1
                assert reg.nodes("prefill")[0].pairing_protocol == reg.nodes("decode")[0].pairing_protocol
                disp = dispatcher(reg, timeouts=StageTimeouts())
                assert not disp.ready()
                assert await disp.probe() and disp.ready()
                return await collect(disp, job("real", ids, max_new_tokens=8, temperature=0.0))
            finally:
                await reg.stop()

        events = run(main(), timeout=120)
        tokens = [t for e in events[:-1] for t in e.token_ids]
        assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 8 == len(tokens)
        # Oracle: the same pair driven directly gives the same greedy tokens.
        oracle, _ = pd_generate(
            stub(prefill.ports["scheduler"]),
            stub(decode.ports["scheduler"]),
            request("oracle", list(ids), 77, prefill.ports["bootstrap"], max_new=8),
        )
        assert tokens == list(oracle[-1].complete.output_ids)
    finally:
        prefill.kill()
        decode.kill()
