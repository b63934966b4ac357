"""One request in flight: its jobs' events merged, rendered, streamed, and watched for a disconnect.

`Fanout` merges the n jobs' events, `Serving` turns them into OpenAI output, `SSEResponse` streams it
and notices a client leaving, `until_disconnect` waits on work meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import suppress
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from router.contract import Dispatcher, DispatchError, FinishEvent, GenerationJob, TokenEvent
from router.errors import APIError, from_dispatch_error
from router.metrics import RouterMetrics
from router.text import RequestOutput

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
ABORT_WAIT_S = 5.0  # how long closing a request waits for its jobs' iterators to abort
T = TypeVar("T")
Item = tuple[int, TokenEvent | FinishEvent]


class Fanout:
    """Runs the n jobs of one request concurrently and merges their events into one queue.

    Each job's iterator is consumed by its own task, so cancelling the task (stop string hit,
    client gone, request over) closes exactly that iterator, which aborts both of its legs.
    """

    def __init__(self, dispatcher: Dispatcher, jobs: list[GenerationJob]) -> None:
        self._dispatcher, self._jobs = dispatcher, jobs
        self._queue: asyncio.Queue[tuple[int, TokenEvent | FinishEvent | DispatchError]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._live = set(range(len(jobs)))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(i, job)) for i, job in enumerate(self._jobs)]

    async def _pump(self, i: int, job: GenerationJob) -> None:
        it: AsyncGenerator[TokenEvent | FinishEvent, None] | None = None
        try:
            it = self._dispatcher.generate(job)
            async for event in it:
                self._queue.put_nowait((i, event))
                if isinstance(event, FinishEvent):
                    return
            raise DispatchError(502, "a node stream ended without a finish event", before_first_token=False)
        except DispatchError as e:
            self._queue.put_nowait((i, e))
        except Exception as e:  # a dispatcher bug must still end the request, with a 502
            log.exception("dispatching %s failed", job.request_id)
            self._queue.put_nowait((i, DispatchError(502, f"dispatch failed: {type(e).__name__}: {e}")))
        finally:
            if it is not None:
                await it.aclose()

    async def next(self) -> Item | None:
        """The next event of a live job; None once every job finished; raises a job's DispatchError."""
        while self._live:
            i, item = await self._queue.get()
            if i not in self._live:
                continue  # a job we cancelled after its stop string: its leftovers do not count
            if isinstance(item, DispatchError):
                raise item
            if isinstance(item, FinishEvent):
                self._live.discard(i)
            return i, item
        return None

    async def cancel(self, i: int) -> None:
        self._live.discard(i)
        self._tasks[i].cancel()
        await asyncio.wait([self._tasks[i]], timeout=ABORT_WAIT_S)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        # Bounded: a dispatcher whose abort hangs must not hold the request (or shutdown) forever.
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=ABORT_WAIT_S)


class SSEResponse(StreamingResponse):
    """An event stream that notices a disconnect whatever the ASGI spec version (Starlette relies on
    a failing send under 2.4, which never comes while the node is silent), then always closes the
    event generator and runs `cleanup` (aborting the jobs); `on_disconnect` runs when the client
    left before the stream's end."""

    def __init__(
        self,
        content: AsyncIterator[str],
        cleanup: Callable[[], Awaitable[None]],
        on_disconnect: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._cleanup, self._on_disconnect = cleanup, on_disconnect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        completed = False
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    nonlocal completed
                    with suppress(OSError):  # a send to a client that left
                        await self.stream_response(send)
                        completed = True
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._cleanup()
            if not completed:
                self._on_disconnect()


async def until_disconnect(request: Request, work: Awaitable[T]) -> tuple[T | None, bool]:
    """(result, False), or (None, True) if the client went away first (then `work` is cancelled)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result(), False
    with suppress(asyncio.CancelledError):
        await task
    return None, True


class Serving:
    """One request in flight: its jobs, output assembly and timing."""

    def __init__(
        self,
        endpoint: str,
        out: RequestOutput,
        jobs: list[GenerationJob],
        t0: float,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
    ) -> None:
        self.endpoint, self.out, self.t0, self.metrics = endpoint, out, t0, metrics
        self.fan = Fanout(dispatcher, jobs)
        self._last: dict[int, float] = {}

    async def apply(self, item: Item) -> list[dict[str, Any]]:
        """Feed one event to its choice; returns the SSE chunks it produced."""
        i, event = item
        if isinstance(event, TokenEvent) and event.token_ids:
            now = time.monotonic()
            self.metrics.observe_tokens(
                self.endpoint, len(event.token_ids), now - self._last.get(i, now), i not in self._last, now - self.t0
            )
            self._last[i] = now
        delta = self.out.apply(i, event)
        if isinstance(event, TokenEvent) and self.out.choices[i].finished:
            await self.fan.cancel(i)  # the router hit a stop string: abort both legs now
        return self.out.chunks(i, delta)

    def done(self) -> None:
        self.metrics.observe_done(
            self.endpoint,
            time.monotonic() - self.t0,
            self.out.disaggregated,
            self.out.prompt_tokens,
            self.out.completion_tokens,
        )

    async def collect(self) -> dict[str, Any]:
        while (item := await self.fan.next()) is not None:
            await self.apply(item)
        self.done()
        return self.out.response()

    async def events(self, first: Item | None) -> AsyncIterator[str]:
        shapes, item = self.out.shapes, first
        try:
            if shapes.chat:  # OpenAI opens every chat choice with its role
                for i in range(len(self.out.choices)):
                    yield sse(shapes.chunk(i, "", role=True))
            for chunk in self.out.opening_chunks():  # echo
                yield sse(chunk)
            while item is not None:
                for chunk in await self.apply(item):
                    yield sse(chunk)
                item = await self.fan.next()
        except Exception as e:
            self.metrics.errors.labels(self.endpoint).inc()
            err = from_dispatch_error(e) if isinstance(e, DispatchError) else APIError(500, f"internal error: {e}")
            yield err.sse_event()
            yield DONE
            return
        self.done()
        if shapes.include_usage:
            yield sse(shapes.usage_chunk(self.out.usage()))
        yield DONE


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
