"""Waiting on transfers at sub-millisecond granularity without blocking the event loop.

An asyncio sleep cannot be shorter than the selector's 1 ms tick, and a KV write of a short
prompt takes about that long: polling from the loop would add up to a millisecond per stage
and per notification to the time to first token. These helpers poll from a worker thread every
POLL_S (GPU memory; POLL_DRAM_S for host memory, whose writes take milliseconds anyway and whose
cores run the model) for at most SLICE_S, then hand back to the loop (so cancellation and
deadlines still work). A transfer someone waits on right now (the final write: the decode's
notification only leaves when the sender's poll sees the data land) is polled every POLL_FAST_S.
Polling runs in a pool of its own whose threads sleep as long as asked (see `_precise_sleeps`).
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from engine.kv_transfer.base import KVPoll, KVTransport

POLL_S = 100e-6  # KV in VRAM: a short prompt's write takes about a millisecond
POLL_FAST_S = 20e-6  # a final write in flight in VRAM: bounded by the write (~1 ms)
POLL_DRAM_S = 1e-3  # KV in host memory: writes take milliseconds, and the cores are the compute
SLICE_S = 0.002
TIMER_SLACK_NS = 1000  # Linux rounds a thread's sleeps up by its timer slack, 50 us by default
T = TypeVar("T")
H = TypeVar("H")


def poll_interval(transport: KVTransport, urgent: bool = False) -> float:
    """How often to poll this transport's transfers: often for GPU memory (more often for one
    the time to first token waits on), gently for host memory."""
    if transport.layout().mem_type != "VRAM":
        return POLL_DRAM_S
    return POLL_FAST_S if urgent else POLL_S


def settled(state: KVPoll) -> bool:
    return state is not KVPoll.TRANSFERRING


async def wait_settled(poll: Callable[[], KVPoll], deadline: float, every: float = POLL_S) -> KVPoll:
    """Poll until the transfer leaves TRANSFERRING or `deadline` (time.monotonic) passes. One poll
    on the loop first: a transfer that already ended costs no thread round trip."""
    state = poll()
    while not settled(state) and time.monotonic() < deadline:
        state = await _in_poller(_spin, poll, settled, every)
    return state


def post_and_wait(
    post: Callable[[], H], poll: Callable[[H], KVPoll], every: float = POLL_S, slice_s: float = SLICE_S
) -> Future[tuple[H, KVPoll]]:
    """Post a transfer and poll it for one slice, both in one poller thread, submitted now: a
    transfer that ends within the slice costs one thread round trip in all. The (concurrent)
    future holds (handle, state), or the exception of `post`; a caller that stops waiting cannot
    cancel a post already running, so its callbacks still see the handle. `slice_s` 0: post and
    poll once (for a write nothing waits on yet)."""

    def run() -> tuple[H, KVPoll]:
        handle = post()
        return handle, _spin(lambda: poll(handle), settled, every, slice_s)

    return _POLLERS.submit(run)


async def poll_soon(fetch: Callable[[], list[T]], every: float = POLL_S) -> list[T]:
    """The first non-empty result of `fetch` within one slice (or an empty list)."""
    return await _in_poller(_spin, fetch, bool, every)


def _in_poller(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    return asyncio.get_running_loop().run_in_executor(_POLLERS, fn, *args)


def _spin(fetch: Callable[[], T], ready: Callable[[T], bool], every: float, slice_s: float = SLICE_S) -> T:
    end = time.monotonic() + slice_s
    while True:
        value = fetch()
        if ready(value) or time.monotonic() >= end:
            return value
        time.sleep(every)  # releases the GIL: the scheduler and event loop threads run meanwhile


def _precise_sleeps() -> None:
    """Sleep as long as asked in this poller thread: with Linux's default 50 us timer slack a
    100 us sleep takes ~175 us, latency added to every transfer waited on. Affects the calling
    thread only; a no-op where prctl is unavailable."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(29, TIMER_SLACK_NS, 0, 0, 0)  # PR_SET_TIMERSLACK
        except (OSError, AttributeError):
            pass


# Threads start lazily; one per transfer (or notification queue) waited on at the same time.
_POLLERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="pdserve-kv-poll", initializer=_precise_sleeps)
