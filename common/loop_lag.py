"""Event-loop lag: how late a short timer fires on an asyncio loop, observed into a histogram.

A loop that is busy (a router relaying thousands of stream messages a second, a node's gRPC
server) runs every callback late by as much as its backlog; every stream it serves stands still
meanwhile. The lag is that backlog, measured from inside the loop at a small fixed cost.
"""

from __future__ import annotations

import asyncio
from typing import Callable

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
INTERVAL_S = 0.02  # fifty wake-ups a second: well under a millisecond of the loop's time


async def watch_loop_lag(observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
    """Until cancelled: sleep `interval_s`, observe how much later than that the loop woke."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval_s)
        observe(max(0.0, loop.time() - start - interval_s))


def start_loop_lag_watch(observe: Callable[[float], None]) -> asyncio.Task[None]:
    """The watch as a task of the running loop (cancel it on shutdown)."""
    return asyncio.get_running_loop().create_task(watch_loop_lag(observe), name="loop-lag")
