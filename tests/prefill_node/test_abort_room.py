"""Prefill-side aborts of a room: the decode hears at once when no write into its pages is posted,
and only from the write's own end when one is."""

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


def _abort(servicer: KVControlServicer, room: int) -> None:
    asyncio.run(servicer.AbortRoom(kpb.AbortRoomRequest(room=room, reason="client left"), None))


def _servicer() -> tuple[KVControlServicer, RoomTable, Recorder]:
    rooms, endpoint = RoomTable(orphan_ttl_s=5.0), FakeEndpoint()
    return KVControlServicer(endpoint, rooms), rooms, endpoint.transport  # type: ignore[arg-type]


def test_abort_of_a_room_without_a_posted_write_tells_the_decode_at_once() -> None:
    servicer, rooms, transport = _servicer()
    room = rooms.get_or_create(7)
    room.destination = Destination("decode-a", [1, 2], 0, 20)  # destination, no Generate yet
    _abort(servicer, 7)
    assert room.state is KVPoll.FAILED
    [(peer, msg)] = transport.sent
    kind, number, reason = parse_tag(msg)
    assert (peer, kind, number) == ("decode-a", "fail", 7) and "client left" in reason


def test_abort_during_a_posted_write_waits_for_the_write() -> None:
    servicer, rooms, transport = _servicer()
    room = rooms.get_or_create(8)
    room.destination = Destination("decode-a", [1], 0, 4)
    room.state = KVPoll.TRANSFERRING
    _abort(servicer, 8)
    assert room.state is KVPoll.FAILED and transport.sent == []


def test_abort_before_any_destination_has_no_one_to_tell() -> None:
    servicer, rooms, transport = _servicer()
    _abort(servicer, 9)
    assert rooms.get(9).state is KVPoll.FAILED and transport.sent == []


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
