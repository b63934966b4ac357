"""A follower rank's KV transfer agent: created when its node's endpoint is, driven over its link.

The leader's TpTransport (engine/kv_transfer/tp.py) asks each follower to create a transport over
its own KV pools (its head slice of the target's, its copy of a replicated draft's), to load the
peers it will write to, and to post writes of its head slices. A write waits until this rank has
applied the leader's schedule up to the message after which the pages were final (`after`), so a
follower never sends a page its own forward has not finished writing.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from engine.device_event import DeviceEvent, make_event
from engine.kv_cache import KVPool
from engine.kv_transfer import HandoffRows, KVPoll, TransferError, create_transport
from engine.kv_transfer.tp_slices import PoolShape

log = logging.getLogger(__name__)

_POLL_S = 0.0005
# UCX over TCP (host memory) completes a peer's write into this rank only while this rank's agent
# makes progress: with an agent, look at it this often even with nothing of our own in flight
_TARGET_PROGRESS_S = 0.002


class AppliedPlans:
    """How many plan messages this rank has applied, with a device fence for each on GPUs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.count = 0
        self._cond = threading.Condition()
        self._fences: deque[tuple[int, DeviceEvent]] = deque(maxlen=256)

    def mark(self) -> None:
        fence = make_event(self.device, blocking=True)  # waited on from the transfer thread
        fence.record()
        with self._cond:
            self.count += 1
            self._fences.append((self.count, fence))
            self._cond.notify_all()

    def wait(self, upto: int, timeout: float) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= upto, timeout):
                return False
            fence = next((f for n, f in self._fences if n >= upto), None)
        if fence is not None:
            fence.synchronize()  # the forwards that wrote the pages have run on the device
        return True


class TransferService:
    """Serves the leader's transfer requests on this rank's pipe, on its own thread."""

    def __init__(
        self,
        conn: Connection,
        pools: Callable[[], list[KVPool]],
        shapes: Callable[[], list[PoolShape]],
        applied: AppliedPlans,
    ) -> None:
        self.conn, self.pools, self.shapes, self.applied = conn, pools, shapes, applied
        self.transport: Any = None
        self._inflight: list[tuple[int, Any]] = []
        threading.Thread(target=self._serve, name="tp-transfer", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                idle = 0.5 if self.transport is None else _TARGET_PROGRESS_S
                if self.conn.poll(_POLL_S if self._inflight else idle):
                    key, op, args = self.conn.recv()
                    self._handle(key, op, args)
                self._progress()
                if self.transport is not None:
                    self.transport.drain_notifications()  # progress; a follower expects none
            except (OSError, EOFError):
                return  # the leader is gone; the process exits with it

    def _reply(self, key: int, ok: bool, value: Any) -> None:
        self.conn.send((key, ok, value))

    def _handle(self, key: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            if op == "transport":
                kind, name, options = args
                rows = HandoffRows(8, 2)  # followers carry no handoff rows: the leader's do
                self.transport = create_transport(kind, name, self.pools(), rows, **options)
                self._reply(key, True, (self.transport.metadata(), [s.to_json() for s in self.shapes()]))
            elif op == "load":
                metadata, connect = args
                self._reply(key, True, self.transport.load_agent(metadata, connect=connect))
            elif op == "write":
                self._write(key, *args)
            elif op == "close":
                if self.transport is not None:
                    self.transport.close()
                self._reply(key, True, None)
            else:
                self._reply(key, False, f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - every failure goes back to the leader, named
            self._reply(key, False, f"{type(e).__name__}: {e}")

    def _write(self, key: int, room: int, peer: str, local: Any, remote: Any, after: int, timeout: float) -> None:
        if not self.applied.wait(after, timeout):
            raise TransferError(f"room {room}: this rank had not computed the pages within {timeout:.0f}s")
        self._inflight.append((key, self.transport.write_rows(room, peer, local, remote)))

    def _progress(self) -> None:
        still = []
        for key, handle in self._inflight:
            state = self.transport.poll(handle)
            if state == KVPoll.TRANSFERRING:
                still.append((key, handle))
                continue
            error = self.transport.last_error(handle)
            self.transport.release(handle)
            self._reply(key, state == KVPoll.SUCCESS, error)
        self._inflight = still
