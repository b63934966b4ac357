"""Per-node circuit breaker: closed -> open after N consecutive failures -> half-open after a
cool-down, where exactly one request probes the node; its outcome closes or re-opens the breaker.

Health checks say whether a node answers; the breaker says whether its requests succeed (a node
can answer HealthCheck while every Generate fails, e.g. when its KV transfer is broken).
"""

from __future__ import annotations

import enum
import time
from typing import Callable

from common.defaults import DEFAULT_BREAKER_COOLDOWN, DEFAULT_BREAKER_FAILURES


class BreakerState(enum.IntEnum):
    """Values are what the router's breaker-state gauge reports; SMG's `smg_worker_cb_state` uses
    the same ones, so one dashboard query (`== 1`: open) reads both."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = DEFAULT_BREAKER_FAILURES,
        cooldown_s: float = DEFAULT_BREAKER_COOLDOWN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.failure_threshold, self.cooldown_s, self.clock = failure_threshold, cooldown_s, clock
        self.failures = 0
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probing = False  # half-open: the one probe request is out

    @property
    def state(self) -> BreakerState:
        # Open turns half-open lazily, on the first look after the cool-down: no timer needed.
        if self._state is BreakerState.OPEN and self.clock() - self._opened_at >= self.cooldown_s:
            self._state, self._probing = BreakerState.HALF_OPEN, False
        return self._state

    def available(self) -> bool:
        """May a request be sent now? (Does not claim the half-open probe; `acquire` does.)"""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._probing)

    def acquire(self) -> bool:
        """Claim the right to send one request; in half-open only the first caller gets it."""
        if not self.available():
            return False
        if self._state is BreakerState.HALF_OPEN:
            self._probing = True
        return True

    def release(self) -> None:
        """The request ended without a verdict (cancelled by the client): free the probe slot."""
        self._probing = False

    def record_success(self) -> None:
        self._state, self.failures, self._probing = BreakerState.CLOSED, 0, False

    def record_failure(self) -> None:
        self.failures += 1
        state = self.state
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED and self.failures >= self.failure_threshold
        ):
            self._state, self._opened_at, self._probing = BreakerState.OPEN, self.clock(), False
