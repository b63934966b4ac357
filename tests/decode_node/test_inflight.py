"""Decode-side request lifecycle: whatever ends a request returns exactly what its stage holds;
pages a write may still land in wait for the write's outcome; early aborts leave tombstones."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from decode_node.inflight import InFlight, Stage
from decode_node.completion import CompletionWaiter
from engine.core import Req, SamplingParams
from engine.kv_transfer import HandoffRows


class FakePD:
    def __init__(self) -> None:
        self.released: list[str] = []
        self.aborted: list[str] = []

    def release(self, req: Req) -> None:
        self.released.append(req.rid)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        self.aborted.append(rid)

    def in_flight(self, rid: str) -> bool:
        return rid == "in-engine"


def _setup(quarantine_s: float = 5.0) -> tuple[InFlight, FakePD, HandoffRows, CompletionWaiter]:
    host_memory = SimpleNamespace(layout=lambda: SimpleNamespace(mem_type="DRAM"))
    pd, rows, waiter = FakePD(), HandoffRows(16, 4), CompletionWaiter(host_memory)  # type: ignore[arg-type]
    return InFlight(pd, rows, waiter, quarantine_s), pd, rows, waiter  # type: ignore[arg-type]


def _req(rid: str) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams())


def test_each_stage_returns_what_it_holds() -> None:
    async def run() -> None:
        inflight, pd, rows, _ = _setup()
        for stage in (Stage.NEW, Stage.RESERVED, Stage.COMMITTED):
            dr = inflight.begin(_req(f"r{stage}"), room=int(stage) + 10)
            dr.stage, dr.row = stage, rows.alloc() if stage is Stage.RESERVED else None
            inflight.settle(dr)
            assert pd.released[-1] == dr.req.rid and dr.row is None
        assert rows.num_used == 0 and not inflight.live
        dr = inflight.begin(_req("adopted"), room=99)
        inflight.handed_over(dr)
        inflight.settle(dr)
        assert pd.aborted == ["adopted"] and "adopted" not in pd.released

    asyncio.run(run())


def test_pages_a_write_may_land_in_wait_for_its_outcome() -> None:
    async def run() -> None:
        inflight, pd, rows, waiter = _setup()
        dr = inflight.begin(_req("x"), room=7)
        dr.row, dr.stage = rows.alloc(), Stage.SENT
        waiter.expect(7, "prefill-agent")
        inflight.settle(dr)  # the client left while the prefill may be writing
        assert pd.released == [] and rows.num_used == 1 and inflight.room_in_use(7)
        assert inflight.counts()["transfer"] == 1
        waiter.resolve(7, "done", "")  # the write ended: now nothing can land any more
        await asyncio.sleep(0)
        assert pd.released == ["x"] and rows.num_used == 0 and not inflight.room_in_use(7)

    asyncio.run(run())


def test_quarantine_has_a_deadline() -> None:
    async def run() -> None:
        inflight, pd, rows, waiter = _setup(quarantine_s=0.05)
        dr = inflight.begin(_req("y"), room=8)
        dr.row, dr.stage = rows.alloc(), Stage.SENT
        waiter.expect(8, "prefill-agent")
        inflight.settle(dr)
        await asyncio.sleep(0.2)  # the prefill never said anything
        assert pd.released == ["y"] and rows.num_used == 0

    asyncio.run(run())


def test_an_abort_before_the_generate_ends_it_on_arrival() -> None:
    async def run() -> None:
        inflight, pd, _, _ = _setup()
        inflight.abort("early", "client gone")  # overtook the router's first message
        dr = inflight.begin(_req("early"), room=5)
        assert dr.aborted.is_set() and dr.abort_reason == "client gone"
        late = inflight.begin(_req("other"), room=6)
        assert not late.aborted.is_set()
        inflight.abort("other", "now")
        assert late.aborted.is_set()

    asyncio.run(run())


def test_a_request_id_already_live_is_refused_and_the_first_keeps_going() -> None:
    from engine.core import InvalidRequest

    pending, _, _, _ = _setup()
    first = pending.begin(_req("dup"), 1)
    with pytest.raises(InvalidRequest, match="already in flight"):
        pending.begin(_req("dup"), 2)
    with pytest.raises(InvalidRequest, match="already in flight"):
        pending.begin(_req("in-engine"), 3)  # adopted by the engine, no longer in `live`
    assert pending.live["dup"] is first and not first.aborted.is_set()


def test_the_prefills_word_that_nothing_is_in_flight_ends_a_quarantine_at_once() -> None:
    async def run() -> None:
        inflight, pd, rows, waiter = _setup()
        dr = inflight.begin(_req("z"), room=9)
        dr.row, dr.stage = rows.alloc(), Stage.SENT
        waiter.expect(9, "prefill-agent")
        inflight.settle(dr)
        inflight.writes_over(10, "another room")  # not this one: it stays
        await asyncio.sleep(0)
        assert pd.released == [] and rows.num_used == 1
        inflight.writes_over(9, "the prefill has no write of the room in flight")
        await asyncio.sleep(0)
        assert pd.released == ["z"] and rows.num_used == 0 and not inflight.room_in_use(9)
        assert len(waiter) == 0

    asyncio.run(run())
