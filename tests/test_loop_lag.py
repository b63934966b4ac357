"""Event-loop lag (common/loop_lag.py): a loop held by a long callback shows it as lag, an idle
one shows next to none; the router exports it with its process CPU."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import generate_latest

from common.loop_lag import watch_loop_lag
from router.metrics import RouterMetrics


def test_a_loop_held_by_a_blocking_callback_shows_the_hold_as_lag() -> None:
    lags: list[float] = []

    async def scenario() -> None:
        watch = asyncio.create_task(watch_loop_lag(lags.append, interval_s=0.01))
        await asyncio.sleep(0.1)  # idle: every wake-up near on time
        idle = list(lags)
        time.sleep(0.2)  # a callback that holds the loop (as a relay with a backlog would)
        await asyncio.sleep(0.05)
        watch.cancel()
        assert idle and max(idle) < 0.05, idle
        assert max(lags) >= 0.15, lags

    asyncio.run(scenario())


def test_the_router_exports_its_loop_lag_and_process_cpu() -> None:
    metrics = RouterMetrics()
    metrics.loop_lag.observe(0.3)
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve_router_event_loop_lag_seconds_bucket{le="0.5"} 1.0' in text
    assert "process_cpu_seconds_total" in text  # Linux: the process collector's figures
