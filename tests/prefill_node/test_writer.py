"""RoomWriter: chunk pages go ahead as the prompt runs; the final write waits for every chunk
write; a retraction starts over; a failed chunk fails the room; cleanup waits for writes in flight."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.device_event import make_event
from engine.kv_transfer import KVPoll
from engine.scheduler.kv_progress import KVProgress
from prefill_node.rooms import Destination, Room
from prefill_node.writer import RoomWriter, WriteFailed


class ScriptedTransport:
    """Records writes; each stays TRANSFERRING for `polls` polls, then ends as `outcome`."""

    def __init__(self, polls: int = 2, outcome: KVPoll = KVPoll.SUCCESS) -> None:
        self.writes: list[tuple[list[int], list[int], bool]] = []
        self.left: dict[int, int] = {}
        self.released: list[int] = []
        self.polls, self.outcome = polls, outcome

    def write(self, req) -> int:
        self.writes.append((req.src_pages, req.dst_pages, req.is_final))
        self.left[len(self.writes)] = self.polls
        return len(self.writes)

    def poll(self, handle: int) -> KVPoll:
        if self.left[handle] > 0:
            self.left[handle] -= 1
            return KVPoll.TRANSFERRING
        return self.outcome

    def release(self, handle: int) -> None:
        self.released.append(handle)

    def last_error(self, handle: int) -> str:
        return "scripted failure"

    def layout(self) -> SimpleNamespace:
        return SimpleNamespace(mem_type="DRAM")


def _progress(pages: tuple[int, ...]) -> KVProgress:
    return KVProgress(pages, make_event("cpu"))


def _room() -> Room:
    room = Room(1, request_id="r", state=KVPoll.WAITING_FOR_INPUT)
    room.destination = Destination("decode", [100 + i for i in range(6)], 3, 24)
    return room


async def _feed(writer: RoomWriter, *progress: KVProgress) -> None:
    loop = asyncio.get_running_loop()
    for p in progress:
        writer.offer(p, loop)
        await asyncio.sleep(0.01)


def test_chunks_go_ahead_and_the_final_write_carries_the_rest() -> None:
    async def run() -> tuple[ScriptedTransport, int]:
        t = ScriptedTransport()
        writer = RoomWriter(t, _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)), _progress((7, 8, 9, 10)))
        sent = await writer.settle_chunks()
        await writer.write_final([11, 12], [104, 105], 0, 3)
        return t, sent

    t, sent = asyncio.run(run())
    assert sent == 4
    assert t.writes == [([7, 8], [100, 101], False), ([9, 10], [102, 103], False), ([11, 12], [104, 105], True)]
    assert t.released == [1, 2, 3]


def test_chunks_done_before_the_destination_leave_when_it_arrives() -> None:
    """The prompt starts before the decode's destination: finished chunks wait for it, then go
    in one write; a room that never gets one sends nothing and its writer still settles."""

    async def run() -> tuple[ScriptedTransport, int, int]:
        t = ScriptedTransport()
        room = _room()
        dest, room.destination, room.state = room.destination, None, KVPoll.BOOTSTRAPPING
        writer = RoomWriter(t, room, 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)), _progress((7, 8, 9, 10)))
        assert t.writes == []
        room.destination = dest
        room.arrived.set()
        await asyncio.sleep(0.05)
        sent = await writer.settle_chunks()
        lonely = RoomWriter(t, Room(2), 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(lonely, _progress((1, 2)))
        return t, sent, await lonely.settle_chunks()

    t, sent, lonely_sent = asyncio.run(run())
    assert sent == 4 and lonely_sent == 0
    assert [w[:2] for w in t.writes] == [([7, 8, 9, 10], [100, 101, 102, 103])] or [w[:2] for w in t.writes] == [
        ([7, 8], [100, 101]),
        ([9, 10], [102, 103]),
    ]


def test_chunks_that_finished_meanwhile_go_in_one_write() -> None:
    """The writer fell behind three chunks: the newest fence covers them all, one write."""

    async def run() -> ScriptedTransport:
        t = ScriptedTransport()
        writer = RoomWriter(t, _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        for pages in ((7, 8), (7, 8, 9, 10), (7, 8, 9, 10, 11, 12)):
            writer.offer(_progress(pages), loop)
        await asyncio.sleep(0.05)
        assert await writer.settle_chunks() == 6
        return t

    t = asyncio.run(run())
    assert t.writes == [([7, 8, 9, 10, 11, 12], [100, 101, 102, 103, 104, 105], False)]


def test_a_retraction_voids_what_was_sent() -> None:
    async def run() -> int:
        writer = RoomWriter(ScriptedTransport(), _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)), _progress(()))
        return await writer.settle_chunks()

    assert asyncio.run(run()) == 0


def test_off_sends_nothing_ahead() -> None:
    async def run() -> tuple[ScriptedTransport, int]:
        t = ScriptedTransport()
        writer = RoomWriter(t, _room(), 5.0, per_chunk=False)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)))
        return t, await writer.settle_chunks()

    t, sent = asyncio.run(run())
    assert (t.writes, sent) == ([], 0)


def test_a_failed_chunk_fails_the_room() -> None:
    async def run() -> None:
        writer = RoomWriter(ScriptedTransport(outcome=KVPoll.FAILED), _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)))
        await writer.settle_chunks()

    with pytest.raises(WriteFailed, match="scripted failure"):
        asyncio.run(run())


def test_cleanup_waits_for_writes_in_flight() -> None:
    async def run() -> list[str]:
        t, events = ScriptedTransport(polls=20), []
        writer = RoomWriter(t, _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)))
        writer.after_writes(lambda: events.append(f"cleanup after {len(t.released)} released"))
        events.append("asked")
        while len(events) < 2:
            await asyncio.sleep(0.005)
        return events

    assert asyncio.run(run()) == ["asked", "cleanup after 1 released"]


class SlowPostTransport(ScriptedTransport):
    """Posting takes `post_s` (a large write's descriptors on the CPU); writes end as scripted."""

    def __init__(self, post_s: float, polls: int = 2) -> None:
        super().__init__(polls)
        self.post_s = post_s

    def write(self, req) -> int:
        import time

        time.sleep(self.post_s)
        return super().write(req)


def test_chunk_writes_end_while_the_prompt_runs() -> None:
    """A chunk write is polled to its end right after it is posted, so the prompt's end finds
    nothing left to wait for."""

    async def run() -> tuple[list[int], int]:
        t = ScriptedTransport(polls=3)
        writer = RoomWriter(t, _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)))
        await asyncio.sleep(0.05)  # the next chunk computes
        released_before_the_end = list(t.released)
        return released_before_the_end, await writer.settle_chunks()

    released, sent = asyncio.run(run())
    assert released == [1] and sent == 2


def test_the_prompts_end_takes_over_a_chunk_write_still_in_flight_at_once() -> None:
    """Chunk writes are polled gently while the prompt runs; settling does not wait for that
    cadence (it polls the write itself, fast), nor does a write still in flight get lost."""
    import time

    async def run() -> tuple[float, int, list[int]]:
        t = ScriptedTransport(polls=10**6)  # never ends while the prompt runs
        writer = RoomWriter(t, _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        await _feed(writer, _progress((7, 8)))
        await asyncio.sleep(0.02)
        assert t.released == [] and writer.in_flight
        t.left[1] = 3  # it lands now: three more polls
        t0 = time.perf_counter()
        sent = await writer.settle_chunks()
        return time.perf_counter() - t0, sent, list(t.released)

    took, sent, released = asyncio.run(run())
    assert sent == 2 and released == [1]
    assert took < 0.5  # bounded by the fast polls, not by a poll slice of the gentle cadence


@pytest.mark.parametrize("stage", ["chunk", "final"])
def test_a_caller_cancelled_while_a_write_is_posted_still_waits_for_it(stage: str) -> None:
    """The request goes away while a write is being posted: the write may land, so cleanup
    (pages and row back to their pools) runs only after the write was polled to its end."""

    async def run() -> list[str]:
        t, events = SlowPostTransport(post_s=0.05), []
        writer = RoomWriter(t, _room(), 5.0, per_chunk=True)  # type: ignore[arg-type]
        if stage == "chunk":
            writer.offer(_progress((7, 8)), asyncio.get_running_loop())
            await asyncio.sleep(0.01)  # the chunk write is being posted
            caller = asyncio.ensure_future(writer.settle_chunks())
        else:
            caller = asyncio.ensure_future(writer.write_final([7, 8], [100, 101], 1, 3))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        writer.after_writes(lambda: events.append(f"cleanup after {len(t.writes)} posted, {len(t.released)} released"))
        for _ in range(200):
            if events:
                break
            await asyncio.sleep(0.005)
        return events

    assert asyncio.run(run()) == ["cleanup after 1 posted, 1 released"]
