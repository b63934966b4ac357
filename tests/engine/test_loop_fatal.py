"""An engine that can never step again (a tensor-parallel rank died): the serving loop stops
stepping, fails what is in flight and whatever still arrives, and reports itself not alive."""

from __future__ import annotations

import queue

import pytest

from engine.core import FinishReason, SamplingParams
from engine.service.health import HealthWatch
from fixtures.waiting import wait_until

TIMEOUT = 20.0
DEAD = "tensor-parallel rank 1 exited (code -9)"


def _final(q: queue.Queue):
    while True:
        upd = q.get(timeout=TIMEOUT)
        if upd.finished:
            return upd


def test_a_failed_engine_fails_requests_in_flight_and_later_ones(loop) -> None:
    eng = loop.engine
    first: queue.Queue = queue.Queue()
    loop.submit(eng.make_request([5, 6, 7], SamplingParams(max_new_tokens=400, temperature=0.0), "long"), first.put)
    assert first.get(timeout=TIMEOUT).tokens  # running
    assert loop.alive and loop.fault is None
    eng.ranks.failed = DEAD  # what the rank watch records when a follower process exits
    assert not loop.alive and loop.fault == DEAD  # at once, whatever the scheduler thread does
    upd = _final(first)
    assert upd.finish_reason is FinishReason.ABORT and DEAD in upd.finish_detail
    steps = eng.scheduler.stats.copy()
    later: queue.Queue = queue.Queue()
    loop.submit(eng.make_request([1, 2], SamplingParams(max_new_tokens=4), "later"), later.put)
    upd = _final(later)
    assert upd.finish_reason is FinishReason.ABORT and "node failed" in upd.finish_detail
    with pytest.raises(RuntimeError, match="node failed"):
        loop.call(lambda: None).result(TIMEOUT)
    assert eng.scheduler.stats == steps  # nothing stepped since


def test_health_names_the_fault(loop) -> None:
    watch = HealthWatch(lambda: loop.alive, lambda: None, fault=lambda: loop.fault)
    assert watch.check() is None
    loop.engine.ranks.failed = DEAD
    assert wait_until(watch.check, TIMEOUT, "unhealthy") == f"engine stopped: {DEAD}"


def test_a_broken_group_halts_the_loop_even_with_every_rank_alive(loop) -> None:
    """A collective past its deadline (a hung rank) raises from the step: no later step can meet
    the other ranks, so the loop halts as for a dead one."""
    from engine.parallel.channel import TpGroupFailed

    def broken() -> None:
        raise TpGroupFailed("tensor-parallel group broke: timed out")

    loop.engine.scheduler.step = broken
    loop.io._wake.set()
    wait_until(lambda: loop.fault, TIMEOUT, "halted")
    assert not loop.alive and "timed out" in (loop.fault or "") and loop.steps_failed == 1
