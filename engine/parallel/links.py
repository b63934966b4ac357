"""Request/reply pipes between the leader and each follower rank, beside the plan broadcasts.

The plan channel (gloo) carries the schedule in lockstep from the scheduler thread; these pipes
carry what other threads need from a follower (its KV transfer agent: created on demand, peers
loaded, writes posted and completed) without waiting for the schedule. One pipe per follower,
created with the process; replies resolve futures, so any thread may ask.
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)


class RankLinkError(RuntimeError):
    """A follower could not do what it was asked, or its pipe broke (the rank died)."""


class RankLink:
    """The leader's end of one follower's pipe."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank, self.conn = rank, conn
        self._ids = itertools.count()
        self._waiting: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._broken: str | None = None
        threading.Thread(target=self._read, name=f"tp{rank}-link", daemon=True).start()

    def ask(self, op: str, *args: Any) -> Future[Any]:
        """Send `op`; the future resolves with the follower's answer or fails with RankLinkError."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._broken is not None:
                fut.set_exception(RankLinkError(self._broken))
                return fut
            key = next(self._ids)
            self._waiting[key] = fut
            try:
                self.conn.send((key, op, args))
            except (OSError, EOFError, ValueError) as e:
                self._waiting.pop(key, None)
                fut.set_exception(RankLinkError(f"rank {self.rank}: {e}"))
        return fut

    def _read(self) -> None:
        while True:
            try:
                key, ok, value = self.conn.recv()
            except (OSError, EOFError) as e:
                self._fail_all(f"rank {self.rank} is gone ({type(e).__name__})")
                return
            with self._lock:
                fut = self._waiting.pop(key, None)
            if fut is None:
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(RankLinkError(f"rank {self.rank}: {value}"))

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._broken = why
            waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            fut.set_exception(RankLinkError(why))
