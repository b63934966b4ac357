"""Aborts that overtook their request: remembered for a while, so the late request ends on arrival."""

from __future__ import annotations

import time
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


class Tombstones(Generic[K]):
    """Keys aborted before anything knew them, each with its reason, forgotten after `ttl_s`.

    An Abort RPC and the request it names travel on different streams (and, for a PD pair, to
    different nodes), so the abort may come first; without a tombstone the late request would
    run (and hold KV) as if nobody had given up on it.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._dead: dict[K, tuple[str, float]] = {}  # key -> (reason, monotonic expiry)

    def add(self, key: K, reason: str) -> None:
        self._expire()
        self._dead[key] = (reason, time.monotonic() + self.ttl_s)

    def pop(self, key: K) -> str | None:
        """The reason `key` was aborted (forgetting it), or None if it was not."""
        self._expire()
        entry = self._dead.pop(key, None)
        return entry[0] if entry is not None else None

    def __len__(self) -> int:
        self._expire()
        return len(self._dead)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, t) in self._dead.items() if t < now]:
            del self._dead[key]
