"""Waiting on transfers at sub-millisecond granularity without blocking the event loop.

An asyncio sleep cannot be shorter than the selector's 1 ms tick, and a KV write of a short
prompt takes about that long: polling from the loop would add up to a millisecond per stage
and per notification to the time to first token. These helpers poll from a worker thread every
POLL_S for at most SLICE_S, then hand back to the loop (so cancellation and deadlines still work).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

from engine.kv_transfer.base import KVPoll

POLL_S = 100e-6
SLICE_S = 0.002
T = TypeVar("T")


async def wait_settled(poll: Callable[[], KVPoll], deadline: float) -> KVPoll:
    """Poll until the transfer leaves TRANSFERRING or `deadline` (time.monotonic) passes."""
    while True:
        state = await asyncio.to_thread(_spin, poll, lambda s: s is not KVPoll.TRANSFERRING)
        if state is not KVPoll.TRANSFERRING or time.monotonic() >= deadline:
            return state


async def poll_soon(fetch: Callable[[], list[T]]) -> list[T]:
    """The first non-empty result of `fetch` within one slice (or an empty list)."""
    return await asyncio.to_thread(_spin, fetch, bool)


def _spin(fetch: Callable[[], T], ready: Callable[[T], bool]) -> T:
    end = time.monotonic() + SLICE_S
    while True:
        value = fetch()
        if ready(value) or time.monotonic() >= end:
            return value
        time.sleep(POLL_S)
