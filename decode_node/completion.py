"""Completion notifications for rooms a decode node waits on (NIXL notifs tagged with the room)."""

from __future__ import annotations

import asyncio
import logging

from engine.kv_transfer import KVTransport, parse_tag
from engine.kv_transfer.waiting import poll_interval, poll_soon

log = logging.getLogger(__name__)


class CompletionWaiter:
    """Rooms waiting for their write. One task drains the transport's notifications; the
    completion of a room resolves its future with ("done" | "fail" | "abort", reason)."""

    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
        self._waiting: dict[int, tuple[str, asyncio.Future]] = {}  # room -> (peer agent, future)
        self._wake = asyncio.Event()  # a new room: stop the idle sleep and poll at once
        self._every = poll_interval(transport)

    def expect(self, room: int, peer: str) -> asyncio.Future:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[room] = (peer, fut)
        self._wake.set()
        return fut

    def forget(self, room: int) -> None:
        self._waiting.pop(room, None)

    def future(self, room: int) -> asyncio.Future | None:
        entry = self._waiting.get(room)
        return entry[1] if entry is not None else None

    def settled(self, room: int) -> bool:
        """Has the room's write ended one way or the other (or was it never expected)?"""
        fut = self.future(room)
        return fut is None or fut.done()

    def resolve(self, room: int, kind: str, reason: str) -> None:
        entry = self._waiting.get(room)
        if entry is not None and not entry[1].done():
            entry[1].set_result((kind, reason))

    def fail_peer(self, peer: str, reason: str) -> None:
        for p, fut in list(self._waiting.values()):
            if p == peer and not fut.done():
                fut.set_result(("fail", reason))

    def __len__(self) -> int:
        return len(self._waiting)

    async def run(self) -> None:
        while True:
            # poll fast (off the loop, sub-millisecond) while something is in flight; otherwise
            # drain once and sleep until a room is expected
            if self._waiting:
                self._deliver(await poll_soon(self.transport.drain_notifications, self._every))
                continue
            self._deliver(self.transport.drain_notifications())
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    def _deliver(self, notifications: list[tuple[str, bytes]]) -> None:
        for _, msg in notifications:
            try:
                kind, room, reason = parse_tag(msg)
            except ValueError:
                log.warning("ignoring an unknown notification %r", msg[:64])
                continue
            self.resolve(room, kind, reason)
