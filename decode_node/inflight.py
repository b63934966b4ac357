"""Decode-side PD requests before the engine owns them: what each holds, and one place that frees it.

A request moves NEW -> RESERVED (slot, pages, handoff row) -> SENT (the prefill knows where to
write) -> COMMITTED (the write landed and checked out) -> ADOPTED (handed to the scheduler
thread: from here the engine owns it and an abort goes to the engine). Whatever ends it (error,
client cancel, Abort RPC, at any await), `settle` returns exactly what its stage holds:

* NEW / RESERVED / COMMITTED: the row (if any) and the pages now (a release queued on the
  scheduler thread after any reservation still queued, so nothing is missed);
* SENT: a write may be on its way into those pages. They stay in quarantine until the prefill
  proves no write can land any more, and are freed then, so a late write never lands in pages
  someone else got. The proof is the prefill's answer to the room's abort (it never started a
  write, and now never will; or every write of it ended), or the room's completion or failure
  notification (sent once its writes ended); a prefill declared dead, or the deadline, is the
  backstop;
* ADOPTED: an engine abort, queued after the adoption itself.

An Abort RPC that arrives before the request's Generate (it overtook the router's first message)
leaves a tombstone, so the late Generate ends at once instead of reserving anything.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from decode_node.completion import CompletionWaiter
from engine.core import InvalidRequest, Req
from engine.disagg import Destination, DisaggEngine
from engine.kv_transfer import HandoffRows
from engine.service.stream import RequestFailed
from engine.service.tombstones import Tombstones

log = logging.getLogger(__name__)
TOMBSTONE_TTL_S = 60.0


class Stage(enum.IntEnum):
    NEW = 0
    RESERVED = 1
    SENT = 2
    COMMITTED = 3
    ADOPTED = 4


@dataclass
class DecodeRequest:
    req: Req
    room: int
    stage: Stage = Stage.NEW
    row: int | None = None
    peer: Any = None  # decode_node.peers.Peer once connected
    destination: Destination | None = None  # its pages, once reserved
    abort_reason: str | None = None
    created: float = field(default_factory=time.monotonic)
    # set by an Abort RPC: wakes whatever the request waits on (capacity, the prefill's write)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


class InFlight:
    """Every decode request between Generate and adoption, plus tombstones of early aborts."""

    def __init__(self, pd: DisaggEngine, rows: HandoffRows, waiter: CompletionWaiter, quarantine_s: float) -> None:
        self.pd, self.rows, self.waiter, self.quarantine_s = pd, rows, waiter, quarantine_s
        self.live: dict[str, DecodeRequest] = {}
        self._tombstones: Tombstones[str] = Tombstones(TOMBSTONE_TTL_S)
        self.quarantined: dict[int, DecodeRequest] = {}  # room -> request whose pages wait

    def begin(self, req: Req, room: int) -> DecodeRequest:
        if req.rid in self.live or self.pd.in_flight(req.rid):
            raise InvalidRequest(f"request id {req.rid!r} is already in flight on this node")
        dr = DecodeRequest(req, room)
        reason = self._tombstones.pop(req.rid)
        if reason is not None:
            dr.abort_reason = reason
            dr.aborted.set()
        self.live[req.rid] = dr
        return dr

    def begin_local(self, req: Req) -> None:
        """A prompt this node runs itself goes straight to the engine, which owns it from then on;
        an abort that overtook it ends it here."""
        if req.rid in self.live or self.pd.in_flight(req.rid):
            raise InvalidRequest(f"request id {req.rid!r} is already in flight on this node")
        reason = self._tombstones.pop(req.rid)
        if reason is not None:
            raise RequestFailed(f"aborted before it arrived: {reason}", "aborted")

    def room_in_use(self, room: int) -> bool:
        return any(d.room == room and d.stage >= Stage.SENT for d in self.live.values()) or room in self.quarantined

    def abort(self, rid: str, reason: str) -> None:
        """Abort RPC: wherever the request is, it ends; one that has not arrived yet ends on arrival."""
        dr = self.live.get(rid)
        if dr is None:
            self._tombstones.add(rid, reason)
            self.pd.abort(rid, reason)  # adopted already, or unknown: the engine ignores unknown ids
            return
        dr.abort_reason = dr.abort_reason or reason
        dr.aborted.set()

    # ---- ending ----
    def settle(self, dr: DecodeRequest) -> None:
        """Return what `dr` holds (see the module docstring); safe to call once per request."""
        if self.live.get(dr.req.rid) is dr:
            del self.live[dr.req.rid]
        if dr.stage is Stage.ADOPTED:
            self.pd.abort(dr.req.rid, dr.abort_reason or "client cancelled")
            return
        if dr.stage is Stage.SENT and not self.waiter.settled(dr.room):
            self._quarantine(dr)
            return
        self.waiter.forget(dr.room)
        self._free(dr)

    def writes_over(self, room: int, why: str) -> None:
        """The prefill proved that no write into `room`'s pages can land any more: a quarantine
        of them ends now (the same path as the room's failure notification)."""
        if room in self.quarantined:
            self.waiter.resolve(room, "abort", why)

    def handed_over(self, dr: DecodeRequest) -> None:
        """The scheduler thread owns the request now (adoption queued); a later Abort RPC for it
        goes to the engine, which the tombstone-free path of `abort` does."""
        dr.stage = Stage.ADOPTED
        if self.live.get(dr.req.rid) is dr:
            del self.live[dr.req.rid]

    def _free(self, dr: DecodeRequest) -> None:
        if dr.row is not None:
            self.rows.free(dr.row)
            dr.row = None
        self.pd.release(dr.req)  # no-op without a slot; ordered after a queued reservation

    def _quarantine(self, dr: DecodeRequest) -> None:
        self.quarantined[dr.room] = dr
        deadline = time.monotonic() + self.quarantine_s

        def done(_: asyncio.Future) -> None:
            if self.quarantined.pop(dr.room, None) is dr:
                self.waiter.forget(dr.room)
                self._free(dr)

        fut = self.waiter.future(dr.room)
        if fut is None:  # nothing registered any more: nothing can arrive for it
            done(asyncio.get_running_loop().create_future())
            return
        fut.add_done_callback(done)
        asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._expire, dr)

    def _expire(self, dr: DecodeRequest) -> None:
        if self.quarantined.get(dr.room) is dr:
            log.warning(
                "room %d: no word from the prefill within %.0f s of an abort; freeing its pages",
                dr.room,
                self.quarantine_s,
            )
            self.waiter.resolve(dr.room, "fail", "quarantine deadline")

    # ---- reporting ----
    def counts(self) -> dict[str, int]:
        out = {"prealloc": 0, "transfer": 0}
        for dr in self.live.values():
            if dr.stage <= Stage.RESERVED:
                out["prealloc"] += 1
            elif dr.stage is Stage.SENT:
                out["transfer"] += 1
        out["transfer"] += len(self.quarantined)
        return out
