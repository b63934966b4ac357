"""Prefill-side rooms: one per request, from Generate (or an early destination or abort) to its end."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv_transfer import KVPoll, KVTransport, failure_tag

log = logging.getLogger(__name__)


@dataclass
class Destination:
    peer: str  # the decode node's agent name
    pages: list[int]
    aux_row: int
    num_tokens: int
    cached_pages: int = 0  # leading pages the decode holds already (its prefix cache): never written


class Writes(Protocol):
    """The room's writer, as far as an abort needs it (prefill_node.writer.RoomWriter)."""

    @property
    def in_flight(self) -> bool:
        """May a write of the room still land in the decode's pages (posted, or being posted)?"""
        ...


@dataclass
class Room:
    room: int
    request_id: str = ""
    state: KVPoll = KVPoll.BOOTSTRAPPING
    destination: Destination | None = None
    deadline: float = 0.0  # monotonic; owned by the prefill while BOOTSTRAPPING/TRANSFERRING
    reason: str = ""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # destination or failure
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)
    finished_at: float | None = None  # perf_counter when the engine finished the prompt (metrics)
    writes: Writes | None = None  # set once a Generate owns the room

    @property
    def writing(self) -> bool:
        """A write into the destination may still land. Once the room has failed this can only
        go from True to False: every post checks for FAILED first, with no await in between."""
        return self.writes is not None and self.writes.in_flight

    def fail(self, reason: str) -> None:
        """Failed is sticky; a finished transfer stays a success."""
        if self.state not in (KVPoll.SUCCESS, KVPoll.FAILED):
            self.state, self.reason = KVPoll.FAILED, reason
        if self.state is KVPoll.FAILED:
            self.failed.set()
        self.arrived.set()

    def tell_decode(self, transport: KVTransport, reason: str) -> None:
        """Best effort: the decode frees this room's pages now instead of at its own deadline.
        Only said when no write into them is posted, or once that write has ended."""
        if self.destination is None:
            return
        try:
            transport.notify(self.destination.peer, failure_tag(self.room, reason[:200]))
        except Exception:  # noqa: BLE001 - the decode's own deadline still holds
            log.debug("could not notify decode about room %d", self.room, exc_info=True)


class RoomTable:
    """Rooms by number. A destination may arrive before the Generate that owns it; it waits
    (bounded) for its request. Finished rooms are forgotten so a reused number starts fresh."""

    def __init__(self, orphan_ttl_s: float) -> None:
        self._rooms: dict[int, Room] = {}
        self.orphan_ttl_s = orphan_ttl_s

    def get_or_create(self, room: int) -> Room:
        r = self._rooms.get(room)
        if r is None:
            r = self._rooms[room] = Room(room, deadline=time.monotonic() + self.orphan_ttl_s)
        return r

    def abort(self, number: int, reason: str) -> Room:
        """Fail the room, creating it if unknown (not arrived yet, or gone): a destination or a
        Generate for it that comes within the TTL is then refused before anything is written."""
        room = self.get_or_create(number)
        room.fail(reason)
        if not room.request_id:  # else the Generate's end keeps it (the deadline is its own)
            room.deadline = time.monotonic() + self.orphan_ttl_s
        return room

    def get(self, room: int) -> Room | None:
        return self._rooms.get(room)

    def forget(self, room: Room) -> None:
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]

    def by_request(self, request_id: str) -> Room | None:
        return next((r for r in self._rooms.values() if r.request_id == request_id), None)

    def expire_orphans(self) -> list[Room]:
        """Destinations whose Generate never came, and failed rooms: drop them after the TTL and
        return them. A room with a write still in flight stays: an abort of it must hear that it
        is writing."""
        now = time.monotonic()
        dead = [
            r
            for r in self._rooms.values()
            if r.deadline < now and (not r.request_id or r.state is KVPoll.FAILED) and not r.writing
        ]
        for r in dead:
            r.fail("no request arrived for this room")
            del self._rooms[r.room]
        return dead

    def __len__(self) -> int:
        return len(self._rooms)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self._rooms.values():
            out[r.state.name] = out.get(r.state.name, 0) + 1
        return out
