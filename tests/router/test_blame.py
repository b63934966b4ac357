"""Which node a failed attempt is charged to (fake nodes): a decode naming its prefill in its error's
trailing metadata, and stage timeouts decided by which legs still answer a health check."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from router.contract import DispatchError, FinishEvent
from router.dispatch import StageTimeouts
from tests.router.fake_nodes import Behaviour, FakeNode, cluster, collect, dispatcher, job, run, until

QUICK = StageTimeouts(
    prefill_timeout=30, first_token_timeout=0.5, inter_token_timeout=5, abort_timeout=1, health_timeout=0.5
)


def _charged(metrics: CollectorRegistry, node: FakeNode, reason: str) -> float:
    return (
        metrics.get_sample_value(
            "pdserve_router_node_failures_total", {"node": node.address, "role": node.role, "reason": reason}
        )
        or 0.0
    )


def test_a_decode_naming_its_prefill_charges_the_prefill() -> None:
    async def main() -> None:
        stuck = FakeNode("prefill", Behaviour(hang_before_first=True))  # never answers its leg
        spare = FakeNode("prefill", Behaviour(running=5))  # least-load tries the stuck one first
        follower = FakeNode("decode", Behaviour(fail_before_first=True, blame="prefill"))
        good = FakeNode("decode", Behaviour(running=5))  # least-load tries the follower first
        async with cluster(stuck, spare, follower, good) as reg:
            metrics = CollectorRegistry()
            events = await collect(dispatcher(reg, prefill="least_load", metrics_registry=metrics), job())
            assert isinstance(events[-1], FinishEvent)
            assert metrics.get_sample_value("pdserve_router_retries_total", {"reason": "prefill_failed"}) == 1
            await until(lambda: reg.get(stuck.address).breaker.failures == 1)
            assert reg.get(follower.address).breaker.failures == 0
            assert _charged(metrics, stuck, "prefill_failed") == 1 and _charged(metrics, follower, "decode_failed") == 0
            # retried away from the prefill at fault (the healthy decode it was paired with may be reused)
            assert len(spare.requests) == 1 and not stuck.requests[1:]

    run(main())


def test_the_error_names_the_prefill() -> None:
    async def main() -> None:
        p, d = (
            FakeNode("prefill", Behaviour(hang_before_first=True)),
            FakeNode("decode", Behaviour(fail_before_first=True, blame="prefill")),
        )
        async with cluster(p, d) as reg:
            with pytest.raises(DispatchError) as e:
                await collect(dispatcher(reg, max_attempts=1), job())
            assert (e.value.status, e.value.code) == (502, "prefill_failed")
            assert p.address in e.value.message and d.address in e.value.message

    run(main())


CASES = [  # prefill silent, decode silent -> reason, charged roles
    (False, True, "decode_timeout", {"decode"}),  # a stopped decode: not the prefill still waiting for it
    (True, False, "prefill_timeout", {"prefill"}),
    (True, True, "pair_timeout", {"prefill", "decode"}),
    (False, False, "prefill_timeout", {"prefill"}),  # both answer: the decode is waiting for the KV
]


@pytest.mark.parametrize("prefill_silent,decode_silent,reason,charged", CASES)
def test_a_stage_timeout_blames_the_legs_that_do_not_answer(
    prefill_silent: bool, decode_silent: bool, reason: str, charged: set[str]
) -> None:
    async def main() -> None:
        p = FakeNode("prefill", Behaviour(hang_before_first=True))
        d = FakeNode("decode", Behaviour(hang_before_first=True))
        async with cluster(p, d) as reg:  # healthy at the refresh, silent from now on
            p.b.silent, d.b.silent = prefill_silent, decode_silent
            metrics = CollectorRegistry()
            with pytest.raises(DispatchError) as e:
                await collect(dispatcher(reg, max_attempts=2, timeouts=QUICK, metrics_registry=metrics), job())
            assert (e.value.status, e.value.code) == (504, reason)
            assert metrics.get_sample_value("pdserve_router_retries_total", {"reason": reason}) == 1
            nodes: dict[str, Any] = {"prefill": p, "decode": d}
            for role, node in nodes.items():
                want = 1 if role in charged else 0
                await until(lambda: reg.get(node.address).breaker.failures == want)
                assert _charged(metrics, node, reason) == want
            assert len(p.requests) == 1  # nothing to retry on: the pair at fault is excluded

    run(main(), timeout=60)
