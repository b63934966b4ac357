"""Waiting on transfers at sub-millisecond granularity without blocking the event loop.

An asyncio sleep cannot be shorter than the selector's 1 ms tick, and a KV write of a short
prompt takes about that long: polling from the loop would add up to a millisecond per stage
and per notification to the time to first token. These helpers poll from a worker thread every
POLL_S (GPU memory; POLL_DRAM_S for host memory, whose writes take milliseconds anyway and whose
cores run the model) for at most SLICE_S, then hand back to the loop (so cancellation and
deadlines still work).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

from engine.kv_transfer.base import KVPoll, KVTransport

POLL_S = 100e-6  # KV in VRAM: a short prompt's write takes about a millisecond
POLL_DRAM_S = 1e-3  # KV in host memory: writes take milliseconds, and the cores are the compute
SLICE_S = 0.002
T = TypeVar("T")


def poll_interval(transport: KVTransport) -> float:
    """How often to poll this transport's transfers: often for GPU memory, gently for host memory."""
    return POLL_S if transport.layout().mem_type == "VRAM" else POLL_DRAM_S


async def wait_settled(poll: Callable[[], KVPoll], deadline: float, every: float = POLL_S) -> KVPoll:
    """Poll until the transfer leaves TRANSFERRING or `deadline` (time.monotonic) passes."""
    while True:
        state = await asyncio.to_thread(_spin, poll, lambda s: s is not KVPoll.TRANSFERRING, every)
        if state is not KVPoll.TRANSFERRING or time.monotonic() >= deadline:
            return state


async def poll_soon(fetch: Callable[[], list[T]], every: float = POLL_S) -> list[T]:
    """The first non-empty result of `fetch` within one slice (or an empty list)."""
    return await asyncio.to_thread(_spin, fetch, bool, every)


def _spin(fetch: Callable[[], T], ready: Callable[[T], bool], every: float) -> T:
    end = time.monotonic() + max(SLICE_S, every)
    while True:
        value = fetch()
        if ready(value) or time.monotonic() >= end:
            return value
        time.sleep(every)
