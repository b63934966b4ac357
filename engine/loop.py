"""Runs an Engine's scheduler in its own thread for servers: thread-safe submit/abort/call and
per-request update callbacks (the gRPC servicers bridge those into asyncio); an engine that can
never step again (a tensor-parallel rank died) stops the stepping and fails whatever arrives."""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from concurrent.futures import Future
from typing import Any, Callable

from engine.core import FinishReason, InvalidRequest, Req
from engine.engine import Engine, bind_thread_to_device
from engine.parallel.channel import TpGroupFailed
from engine.scheduler import RequestUpdate
from engine.scheduler.updates import final_update

log = logging.getLogger(__name__)
UpdateCallback = Callable[[RequestUpdate], None]


class ThreadedIO:
    """Scheduler inbox/outbox shared by the scheduler thread and server threads.

    `call(fn)` runs `fn` in the scheduler thread between steps, so servers touch the KV
    manager and scheduler state without locks (page reservation, releasing held KV, adopting
    prebuilt requests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[Req] = []
        self._aborts: list[tuple[str, str]] = []
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._subscribers: dict[str, UpdateCallback] = {}
        self._wake = threading.Event()
        self.finished: Counter[str] = Counter()  # finish reason -> requests (node metrics read it)

    def submit(self, req: Req, on_update: UpdateCallback) -> None:
        with self._lock:
            self._claim(req.rid, on_update)
            self._new.append(req)
        self._wake.set()

    def subscribe(self, rid: str, on_update: UpdateCallback) -> None:
        with self._lock:
            self._claim(rid, on_update)

    def in_flight(self, rid: str) -> bool:
        with self._lock:
            return rid in self._subscribers

    def _claim(self, rid: str, on_update: UpdateCallback) -> None:
        # Ids key the updates, aborts and the scheduler's table: a second live request with the
        # same id would take the first one's updates and aborts. Refused, the first keeps going.
        if rid in self._subscribers:
            raise InvalidRequest(f"request id {rid!r} is already in flight on this node")
        self._subscribers[rid] = on_update

    def abort(self, rid: str, reason: str = "aborted") -> None:
        with self._lock:
            self._aborts.append((rid, reason))
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._lock:
            self._calls.append((fn, fut))
        self._wake.set()
        return fut

    # ---- SchedulerIO (scheduler thread) ----
    def poll(self) -> tuple[list[Req], list[str]]:
        self.run_calls()
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        return new, [rid for rid, _ in aborts]

    def run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fn, fut = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller's future
                    fut.set_exception(e)

    def publish(self, updates: list[RequestUpdate]) -> None:
        for upd in updates:
            with self._lock:
                cb = self._subscribers.pop(upd.rid, None) if upd.finished else self._subscribers.get(upd.rid)
                if upd.finished:
                    self.finished[_reason(upd)] += 1
            if cb is not None:
                try:
                    cb(upd)
                except Exception:  # noqa: BLE001 - a broken subscriber must not stop the engine
                    log.exception("update callback for %s failed", upd.rid)

    def refuse_pending(self, detail: str) -> None:
        """Fail every new request and call at once (the engine cannot run them); aborts are moot."""
        with self._lock:
            new, self._new = self._new, []
            self._aborts.clear()
            calls, self._calls = self._calls, deque()
        for _fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(detail))
        for req in new:
            req.finish(FinishReason.ABORT, detail)
        self.publish([final_update(req) for req in new])

    def wait_for_work(self, timeout: float) -> None:
        self._wake.wait(timeout)
        self._wake.clear()

    def reset_finished(self) -> None:
        with self._lock:
            self.finished.clear()

    def finished_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.finished)

    @property
    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._new or self._aborts or self._calls)


def _reason(upd: RequestUpdate) -> str:
    return upd.finish_reason.value if upd.finish_reason is not None else "unknown"


class EngineLoop:
    """The scheduler thread of a serving process."""

    def __init__(self, engine: Engine) -> None:
        if not isinstance(engine.io, ThreadedIO):
            raise TypeError("EngineLoop needs an Engine built with io=ThreadedIO()")
        self.engine = engine
        self.io: ThreadedIO = engine.io
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-scheduler", daemon=True)
        self.steps_failed = 0
        self._fault: str | None = None  # why the loop stopped stepping for good

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.io._wake.set()
        self._thread.join(timeout)

    @property
    def fault(self) -> str | None:
        """Why this node can never step again, or None. Read from the engine too, not only from
        the scheduler thread: that thread may be blocked in a collective with a dead rank."""
        return self._fault or self.engine.fatal

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set() and self.fault is None

    def submit(self, req: Req, on_update: UpdateCallback) -> None:
        self.io.submit(req, on_update)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        self.io.abort(rid, reason)

    def call(self, fn: Callable[[], Any]) -> Future:
        return self.io.call(fn)

    def _run(self) -> None:
        bind_thread_to_device(self.engine.device)  # the current device is per thread
        sched = self.engine.scheduler
        while not self._stop.is_set():
            if self.engine.fatal is not None:
                self._halt(self.engine.fatal)
                break
            try:
                sched.step()
            except TpGroupFailed as e:  # a rank hung or died: no later step can meet the others
                self.steps_failed += 1
                self._halt(str(e))
                break
            except Exception as e:  # noqa: BLE001 - fail the in-flight requests, keep serving
                self.steps_failed += 1
                log.exception("engine step failed; aborting in-flight requests")
                self._fail_all(f"internal error: {type(e).__name__}: {e}")
            if not sched.has_work and not self.io.has_pending:
                self.io.wait_for_work(0.05)
        self._refuse_until_stopped()

    def _halt(self, why: str) -> None:
        """Stop stepping for good: every request in flight fails now (routers retry them elsewhere)."""
        self._fault = why
        log.error("engine failed (%s): failing every request and serving none until restarted", why)
        try:
            self._fail_all(f"node failed: {why}")
        except Exception:  # noqa: BLE001 - the requests' updates are what matter, not this
            log.exception("could not fail the in-flight requests cleanly")

    def _refuse_until_stopped(self) -> None:
        """After a halt, requests and calls that still arrive (a race with health) fail at once."""
        if self._fault is None:
            return
        detail = f"node failed: {self._fault}"
        while not self._stop.is_set():
            self.io.refuse_pending(detail)
            self.io.wait_for_work(0.05)

    def _fail_all(self, detail: str) -> None:
        self.io.publish(self.engine.scheduler.fail_all(detail))
