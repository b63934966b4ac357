"""Is a node able to serve? Liveness of its engine thread, and capacity that leaked.

A node whose scheduler thread died, whose engine failed (a tensor-parallel rank died), or that has
nothing running, queued or in flight and still cannot admit one minimal request (no request slot,
no pages, no handoff row), will never serve again by itself: it reports NOT_SERVING on standard
gRPC health (Kubernetes probes) and unhealthy on the scheduler API's HealthCheck (routers), instead
of answering healthy while refusing work.
A leak must persist for `grace_s` before it counts: the counters are read without locking the
scheduler thread, and a moment between two of its steps may look like one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Protocol

from grpc_health.v1 import health_pb2


class CapacityHolder(Protocol):
    """A role handler's view of what it holds outside the engine's queues."""

    def inflight(self) -> int:
        """Requests it holds capacity for (reserving, transferring, quarantined, held for a write)."""

    def stuck_reason(self) -> str | None:
        """Its own leaked capacity (e.g. handoff rows), or None."""


def leaked_capacity(engine: Any, holder: CapacityHolder | None) -> str | None:
    """Why nothing can be admitted although nothing runs, or None."""
    policy, kv = engine.scheduler.policy, engine.kv
    busy = policy.running or policy.waiting or (holder is not None and holder.inflight())
    if busy:
        return None
    if kv.num_free_slots == 0:
        return f"all {kv.cfg.max_reqs} request slots are held with nothing running"
    need = 1 + engine.executor.kv_tokens_per_decode()
    if kv.pages_for(need) > kv.num_available:
        return f"{kv.num_held} KV pages are held with nothing running"
    return holder.stuck_reason() if holder is not None else None


class HealthWatch:
    """Keeps a node's health verdict and its standard gRPC health statuses up to date."""

    def __init__(
        self,
        engine_alive: Callable[[], bool],
        leak: Callable[[], str | None],
        grace_s: float = 5.0,
        fault: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.engine_alive, self.leak, self.grace_s, self.fault = engine_alive, leak, grace_s, fault
        self._leak_since: float | None = None
        self.reason: str | None = None  # None: healthy

    def check(self) -> str | None:
        if not self.engine_alive():
            why = self.fault()  # e.g. which tensor-parallel rank exited
            self.reason = f"engine stopped: {why}" if why else "engine stopped"
            return self.reason
        why = self.leak()
        now = time.monotonic()
        if why is None:
            self._leak_since = None
        elif self._leak_since is None:
            self._leak_since = now
        self.reason = why if why is not None and now - self._leak_since >= self.grace_s else None
        return self.reason

    async def run(self, servicer: Any, services: list[str], interval_s: float = 1.0) -> None:
        """Publish the verdict on standard gRPC health (`servicer`: grpc_health's aio servicer)."""
        last = None
        while True:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if self.check() is None
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            if status != last:
                for name in services:
                    await servicer.set(name, status)
                last = status
            await asyncio.sleep(interval_s)
