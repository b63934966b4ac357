"""Every KV write of one prefill room: prompt chunks sent while the prompt still runs, then the
final write (the remaining pages + the handoff row, which notifies the decode).

With chunked prefill the scheduler reports, after each non-final chunk, which leading pages of
the request hold final KV (`KVProgress`, with a fence on the device). The writer posts those
pages in a partial write as soon as the fence is reached, so by the time the last chunk is
computed only its own pages are left for the final write. Ordering rules:

* every partial write has ended (and succeeded) before the final write is posted, so the decode's
  completion notification means all pages landed;
* after a retraction (an empty progress) the writer lets posted writes end and starts over;
* whatever ends the room, its pages are freed and the decode is told only once no write of the
  room is in flight any more (`after_writes`), so no write lands in pages handed to someone else.

Latency: chunk writes are polled while the prompt runs (the polls also drive the transport's
progress), so the prompt's end usually finds nothing left to settle. Nothing waits on them yet and
every poll is a driver call beside the scheduler thread's kernel launches, so a chunk is posted
without polling on and then polled on the loop every CHUNK_POLL_S (a poll does not block) until the
next chunk's progress or the prompt's end, which takes over at once. The final write is posted and
polled in one poller-thread round trip, at the fast cadence the decode's notification waits on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Callable

from engine.kv_transfer import KVPoll, KVTransport, TransferError, TransferRequest, coalesce_runs
from engine.kv_transfer.waiting import SLICE_S, poll_interval, post_and_wait, wait_settled
from engine.scheduler.kv_progress import KVProgress
from engine.service.metrics import KV_WRITE_RUNS
from prefill_node.rooms import Room

log = logging.getLogger(__name__)
CHUNK_POLL_S = 1e-3  # chunk writes in flight while the prompt still runs; settling polls urgently


class WriteFailed(RuntimeError):
    """A KV write of the room failed or did not end in time; the message says which and why."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class RoomWriter:
    def __init__(self, transport: KVTransport, room: Room, timeout_s: float, per_chunk: bool) -> None:
        self.transport, self.room, self.timeout_s, self.per_chunk = transport, room, timeout_s, per_chunk
        self.sent = 0  # leading pages covered by posted partial writes
        self.partial_writes = 0
        self.partial_pages = 0  # pages those partial writes carried
        self._posted: list[tuple[object, float]] = []  # (handle, deadline) of writes not yet ended
        self._pending: list[KVProgress] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task | None = None  # sends chunks and ends their writes
        self._posting: set[Future] = set()  # posts still running in a poller thread
        self._error: WriteFailed | None = None
        self._on_idle: list[Callable[[], None]] = []
        self._drainer: asyncio.Task | None = None

    @property
    def floor(self) -> int:
        """Leading pages the decode holds already (none before its destination arrived)."""
        dest = self.room.destination
        return dest.cached_pages if dest is not None else 0

    @property
    def in_flight(self) -> bool:
        """A write of this room may still land in the decode's pages: posted and not yet ended,
        or being posted in a poller thread."""
        return bool(self._posted) or bool(self._posting)

    # ---- chunks (progress offered from the scheduler thread) ----
    def offer(self, progress: KVProgress, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(self._accept, progress)

    def _accept(self, progress: KVProgress) -> None:
        if not self.per_chunk or self._closing:
            return
        self._pending.append(progress)
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while not self._closing:
            await self._until_wake_ending_chunks()
            self._wake.clear()
            while self._pending and not self._closing and self.room.state is not KVPoll.FAILED:
                if self.room.destination is None and not self._pending[0].restarted:
                    await self._until_destination_or_wake()  # the prompt started before it came
                    continue
                await self._apply(self._next_progress())

    async def _until_wake_ending_chunks(self) -> None:
        """Until new progress or the prompt's end: end posted chunk writes meanwhile, polled on
        the loop every CHUNK_POLL_S."""
        while not self._wake.is_set():
            self._retire_ended()
            try:
                await asyncio.wait_for(self._wake.wait(), CHUNK_POLL_S if self._posted else None)
            except asyncio.TimeoutError:
                pass

    def _retire_ended(self) -> None:
        """Release the posted writes that ended (or passed their deadline), with one poll each."""
        t, still = self.transport, []
        for handle, deadline in self._posted:
            state = t.poll(handle)
            if state is KVPoll.TRANSFERRING and time.monotonic() < deadline:
                still.append((handle, deadline))
            else:
                self._retire(handle, state)
        self._posted = still

    def _next_progress(self) -> KVProgress:
        """The oldest pending progress, or, when several chunks finished meanwhile, the newest
        of the run before any retraction: its fence covers the earlier chunks, so one write
        carries them all."""
        n = next((i for i, p in enumerate(self._pending) if p.restarted), len(self._pending))
        if n <= 1:
            return self._pending.pop(0)
        newest = self._pending[n - 1]
        del self._pending[:n]
        return newest

    async def _until_destination_or_wake(self) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in (self.room.arrived, self._wake)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self._wake.clear()

    async def _apply(self, progress: KVProgress) -> None:
        if progress.restarted:  # retracted: what was sent is void, and nothing may overtake it
            await self._end_posted()
            self.sent = 0
            return
        if len(progress.pages) <= max(self.sent, self.floor) or self._error is not None:
            return
        await asyncio.to_thread(progress.fence.synchronize)
        dest, room = self.room.destination, self.room
        if dest is None or room.state is KVPoll.FAILED:
            return
        start, end = max(self.sent, self.floor), len(progress.pages)
        room.state = KVPoll.TRANSFERRING  # a write into its pages is posted from here on
        try:  # posted and polled once: _until_wake_ending_chunks ends it
            await self._post(
                TransferRequest(
                    room.room, dest.peer, list(progress.pages[start:end]), dest.pages[start:end], None, None
                ),
                urgent=False,
            )
        except TransferError as e:
            self._error = WriteFailed(f"KV chunk write failed: {e}", "transfer_error")
            return
        self.partial_writes += 1
        self.partial_pages += end - start
        self.sent = end

    def _post(self, request: TransferRequest, urgent: bool) -> asyncio.Future:
        """Post a write in a poller thread and, if `urgent`, poll it there for one slice (a chunk
        write is polled once; `_until_wake_ending_chunks` ends it); the future holds (handle,
        state). The handle is recorded as posted in the same loop callback that
        resolves the future, also when the caller was cancelled meanwhile: a write that may land
        is always waited for before its pages or row are reused."""
        # the copies it takes: what fragmented pages on either side cost (a mismatch is the
        # transport's to refuse, as a TransferError)
        if request.src_pages and len(request.src_pages) == len(request.dst_pages):
            KV_WRITE_RUNS.labels("final" if urgent else "chunk").observe(
                len(coalesce_runs(request.src_pages, request.dst_pages)[2])
            )
        deadline = time.monotonic() + self.timeout_s
        every = poll_interval(self.transport, True)
        posting = post_and_wait(
            lambda: self.transport.write(request), self.transport.poll, every, SLICE_S if urgent else 0.0
        )
        self._posting.add(posting)
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        posting.add_done_callback(lambda f: loop.call_soon_threadsafe(self._posted_one, f, result, deadline))
        return result

    def _posted_one(self, posting: Future, result: asyncio.Future, deadline: float) -> None:
        self._posting.discard(posting)
        error = posting.exception()
        if error is None:
            self._posted.append((posting.result()[0], deadline))
        if result.cancelled():  # the caller went away; a failed post already has nothing to wait for
            return
        if error is None:
            result.set_result(posting.result())
        else:
            result.set_exception(error)

    async def settle_chunks(self) -> int:
        """The prompt is computed: stop sending chunks, wait until every partial write ended,
        and return how many leading pages the decode already has (raises WriteFailed)."""
        restart = any(p.restarted for p in self._pending)
        self._pending.clear()
        self._closing = True
        self._wake.set()
        if self._task is not None:  # shielded: cancelling this caller must not orphan a post
            await asyncio.shield(self._task)
        await self._end_posted(urgent=True)
        if restart:
            self.sent = 0
        if self._error is not None:
            raise self._error
        return max(self.sent, self.floor)

    # ---- the final write ----
    async def write_final(self, src_pages: list[int], dst_pages: list[int], src_row: int, dst_row: int) -> None:
        """Post the remaining pages + the handoff row (the decode is notified on completion) and
        wait for it to end; raises WriteFailed."""
        dest, room = self.room.destination, self.room
        assert dest is not None
        # posting may copy synchronously (CPU): off the event loop. A caller that goes away
        # meanwhile still leaves the handle for after_writes to wait on (`_post`).
        try:
            await self._post(TransferRequest(room.room, dest.peer, src_pages, dst_pages, src_row, dst_row), urgent=True)
        except TransferError as e:
            raise WriteFailed(f"KV write failed: {e}", "transfer_error") from None
        await self._end_posted(urgent=True)
        if self._error is not None:
            raise self._error

    # ---- ending ----
    async def _end_posted(self, urgent: bool = False) -> None:
        """Poll every posted write until it ends or passes its deadline, then release it.
        `urgent`: the first token waits on these writes (poll at the fast cadence)."""
        t = self.transport
        every = poll_interval(t, True) if urgent else max(poll_interval(t), CHUNK_POLL_S)
        while self._posted:
            handle, deadline = self._posted[0]
            state = await wait_settled(lambda h=handle: t.poll(h), deadline, every)
            self._retire(handle, state)
            self._posted.pop(0)
        if not self._posting:  # else the drainer runs them once that post is recorded and ended
            self._run_idle_callbacks()

    def _retire(self, handle: object, state: KVPoll) -> None:
        """A posted write that ended (or ran out of time): note its failure, release it."""
        t = self.transport
        if state is KVPoll.FAILED and self._error is None:
            self._error = WriteFailed(f"KV write failed: {t.last_error(handle) or 'unknown reason'}", "transfer_error")
        elif state is KVPoll.TRANSFERRING and self._error is None:
            self._error = WriteFailed(f"KV write did not finish within {self.timeout_s:.0f} s", "transfer_timeout")
        t.release(handle)

    def after_writes(self, callback: Callable[[], None]) -> None:
        """Run `callback` once no write of the room is in flight (now, if none is): stops chunk
        sending and ends posted writes in the background (for requests whose caller went away)."""
        self._closing = True
        self._pending.clear()
        self._wake.set()
        self._on_idle.append(callback)
        if not self._posted and not self._busy():
            self._run_idle_callbacks()
        elif self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain_in_background())

    def _busy(self) -> bool:
        """May a posted write still be added: a post running, or the chunk task?"""
        return bool(self._posting) or (self._task is not None and not self._task.done())

    async def _drain_in_background(self) -> None:
        while self._busy():  # a post is recorded (`_posted_one`) before this wait returns
            task = [self._task] if self._task is not None and not self._task.done() else []
            await asyncio.wait([*(asyncio.wrap_future(p) for p in self._posting), *task])
        if self._task is not None and not self._task.cancelled():
            self._task.exception()  # retrieved: its error already failed the request
        await self._end_posted()

    def _run_idle_callbacks(self) -> None:
        callbacks, self._on_idle = self._on_idle, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - one cleanup step must not skip the others
                log.exception("room %d: cleanup after its writes failed", self.room.room)
