"""Prefill-side aborts of a room: the answer (and, for older decodes, a notification) says at once
when no write into its pages is in flight or can be posted any more; with one in flight the decode
hears only from the write's own end. A room aborted before it arrived refuses what comes later."""

from __future__ import annotations

import asyncio

from engine.kv_transfer import KVPoll, parse_tag
from pdserve.v1 import kv_control_pb2 as kpb
from prefill_node.control import KVControlServicer
from prefill_node.rooms import Destination, RoomTable


class Recorder:
    """Transport stand-in that records notifications."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def notify(self, peer: str, message: bytes) -> None:
        self.sent.append((peer, message))


class FakeEndpoint:
    def __init__(self) -> None:
        self.transport = Recorder()


class Writing:
    """A room's writer with a write posted and not yet ended."""

    in_flight = True


class Context:
    """The servicer context as SendDestination reads it: a call with time left."""

    def time_remaining(self) -> float | None:
        return 5.0


def _abort(servicer: KVControlServicer, room: int) -> int:
    ack = asyncio.run(servicer.AbortRoom(kpb.AbortRoomRequest(room=room, reason="client left"), None))
    return ack.writes


def _servicer() -> tuple[KVControlServicer, RoomTable, Recorder]:
    rooms, endpoint = RoomTable(orphan_ttl_s=5.0), FakeEndpoint()
    return KVControlServicer(endpoint, rooms), rooms, endpoint.transport  # type: ignore[arg-type]


def test_abort_of_a_room_without_a_posted_write_tells_the_decode_at_once() -> None:
    servicer, rooms, transport = _servicer()
    room = rooms.get_or_create(7)
    room.destination = Destination("decode-a", [1, 2], 0, 20)  # destination, no Generate yet
    assert _abort(servicer, 7) == kpb.ROOM_WRITES_NONE_IN_FLIGHT
    assert room.state is KVPoll.FAILED
    [(peer, msg)] = transport.sent
    kind, number, reason = parse_tag(msg)
    assert (peer, kind, number) == ("decode-a", "fail", 7) and "client left" in reason


def test_abort_during_a_posted_write_waits_for_the_write() -> None:
    servicer, rooms, transport = _servicer()
    room = rooms.get_or_create(8)
    room.destination = Destination("decode-a", [1], 0, 4)
    room.state, room.writes = KVPoll.TRANSFERRING, Writing()
    assert _abort(servicer, 8) == kpb.ROOM_WRITES_IN_FLIGHT
    assert room.state is KVPoll.FAILED and transport.sent == []
    room.writes.in_flight = False  # ended: a second abort (idempotent) may free at once
    assert _abort(servicer, 8) == kpb.ROOM_WRITES_NONE_IN_FLIGHT


def test_abort_between_chunk_writes_frees_at_once() -> None:
    """A room that wrote chunks but has none in flight never posts another once failed."""
    servicer, rooms, transport = _servicer()
    room = rooms.get_or_create(10)
    room.destination, room.request_id = Destination("decode-a", [1, 2], 0, 8), "r10"
    room.state, room.writes = KVPoll.TRANSFERRING, Writing()
    room.writes.in_flight = False
    assert _abort(servicer, 10) == kpb.ROOM_WRITES_NONE_IN_FLIGHT
    assert [parse_tag(m)[:2] for _, m in transport.sent] == [("fail", 10)]


def test_abort_before_any_destination_has_no_one_to_tell() -> None:
    servicer, rooms, transport = _servicer()
    assert _abort(servicer, 9) == kpb.ROOM_WRITES_NONE_IN_FLIGHT  # the answer is the decode's word
    assert rooms.get(9).state is KVPoll.FAILED and transport.sent == []


def test_a_destination_after_the_rooms_abort_is_refused() -> None:
    """The decode's destination call and its abort race (the call was cancelled in flight): an
    abort that came first keeps the room failed, so the destination never gets written."""
    servicer, rooms, _ = _servicer()
    servicer.peers.add("decode-a")
    _abort(servicer, 13)
    dest = kpb.DestinationRequest(room=13, decode_agent="decode-a", pages=[1], aux_row=0, num_tokens=4)
    ack = asyncio.run(servicer.SendDestination(dest, Context()))  # type: ignore[arg-type]
    assert not ack.accepted and "aborted by decode" in ack.error
    assert rooms.get(13).destination is None


def test_an_aborted_room_outlives_its_ttl_while_a_write_is_in_flight() -> None:
    import time

    servicer, rooms, _ = _servicer()
    room = rooms.get_or_create(14)
    room.request_id, room.writes = "r14", Writing()
    _abort(servicer, 14)
    room.deadline = time.monotonic() - 1.0
    assert len(rooms.expire_orphans()) == 0 and rooms.get(14) is room
    room.writes.in_flight = False
    assert len(rooms.expire_orphans()) == 1 and rooms.get(14) is None


def test_a_destination_that_came_in_time_outlives_a_long_prompt() -> None:
    """The prompt runs while the destination arrives: a prompt that ends after the bootstrap
    deadline still finds the destination that came before it; with none, it fails at once."""
    import time

    import pytest

    from engine.service.stream import RequestFailed
    from prefill_node.handler import PrefillHandler, PrefillTimeouts

    rooms = RoomTable(orphan_ttl_s=5.0)
    handler = PrefillHandler(None, None, rooms, PrefillTimeouts())  # type: ignore[arg-type]
    came = rooms.get_or_create(11)
    came.destination, came.deadline = Destination("decode-a", [1], 0, 4), time.monotonic() - 1.0
    came.arrived.set()
    asyncio.run(handler._wait_destination(came))
    assert came.state is KVPoll.WAITING_FOR_INPUT
    late = rooms.get_or_create(12)
    late.deadline = time.monotonic() - 1.0
    with pytest.raises(RequestFailed, match="no destination"):
        asyncio.run(handler._wait_destination(late))
