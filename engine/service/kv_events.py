"""A node's KV cache events for SubscribeKvEvents: the radix cache's changes in numbered batches, or a snapshot.

The log is the radix cache's listener (engine/radix_cache.py): on the scheduler thread it only
appends to a pending list and updates its own copy of what is cached (hash -> parent, tokens),
under a lock held for O(1) work. Pending events become a batch, numbered 1, 2, ... with no gap,
when a subscriber reads (every `interval`, from the asyncio side) or, with nobody reading, when
`max_pending` blocks wait. A bounded ring keeps the last batches (at most `max_events` events).

A subscriber asks for `start_sequence_number` N:
- N within the ring (or the next one): the batches from N on, then live ones.
- N = 0 (SMG's "start from the current state"), N older than the ring (it overflowed meanwhile)
  or N past the last batch (the node restarted since the subscriber's cursor): a snapshot, as
  `KvSnapshotChunk`s, whose semantics fit exactly: chunk 0 begins with a KvCacheCleared, stored
  events list every cached page parents before children (event_id 0), and the chunks carry
  consecutive sequence numbers ending at the batch the state was taken at, so live batches follow
  with no gap and no duplicate. `unknown_before` is 0: the listener is attached when the node
  starts and first hears of anything already cached. With no batch yet the one chunk is numbered 0.
Protos are built outside the lock, per read. No load records are sent (`load` unset), so
`load_records_before_first_batch` changes nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

from smg_grpc_proto.generated import common_pb2 as cpb

from common.prefix_hash import ROOT

Block = tuple[int, tuple[int, ...]]  # (hash, tokens)


@dataclass(frozen=True, slots=True)
class _Stored:
    event_id: int
    parent: int
    blocks: list[Block]


@dataclass(frozen=True, slots=True)
class _Removed:
    event_id: int
    hashes: list[int]


_Event = _Stored | _Removed


@dataclass(frozen=True, slots=True)
class _Batch:
    seq: int
    timestamp: float
    events: list[_Event]
    size: int  # blocks named by its events


class KvEventLog:
    """Thread-safe: the cache's listener on the scheduler thread, read by stream tasks."""

    def __init__(self, page_size: int, max_events: int = 65536, max_pending: int = 4096, chunk_blocks: int = 2048):
        self.page_size, self.max_events, self.max_pending, self.chunk_blocks = (
            page_size,
            max_events,
            max_pending,
            chunk_blocks,
        )
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: list[_Event] = []
        self._pending_size = 0
        self._ring: deque[_Batch] = deque()
        self._ring_size = 0
        self._last = 0  # the newest batch's number (0: none yet)
        # what is cached now, in insertion order: a parent always precedes its children, since the
        # cache drops only leaves and a page is stored after its parent
        self._live: dict[int, tuple[int, tuple[int, ...]]] = {}

    # ---- CacheListener (the scheduler thread) ----
    def stored(self, parent: int, blocks: list[Block]) -> None:
        with self._lock:
            p = parent
            for h, tokens in blocks:
                self._live[h] = (p, tokens)
                p = h
            self._add(_Stored(next(self._ids), parent, blocks), len(blocks))

    def removed(self, hashes: list[int]) -> None:
        with self._lock:
            for h in hashes:
                self._live.pop(h, None)
            self._add(_Removed(next(self._ids), hashes), len(hashes))

    def _add(self, event: _Event, size: int) -> None:
        self._pending.append(event)
        self._pending_size += size
        if self._pending_size >= self.max_pending:  # nobody reads: keep the pending list bounded
            self._seal()

    # ---- readers ----
    @property
    def last_sequence(self) -> int:
        with self._lock:
            return self._last

    def cached_blocks(self) -> int:
        with self._lock:
            return len(self._live)

    def seal(self) -> int:
        """Make the pending events a batch; returns the newest batch's number."""
        with self._lock:
            self._seal()
            return self._last

    def _seal(self) -> None:
        if not self._pending:
            return
        self._last += 1
        batch = _Batch(self._last, time.time(), self._pending, self._pending_size)
        self._pending, self._pending_size = [], 0
        self._ring.append(batch)
        self._ring_size += batch.size
        while self._ring_size > self.max_events and len(self._ring) > 1:
            self._ring_size -= self._ring.popleft().size

    def read(self, cursor: int) -> list[cpb.KvEventBatch]:
        """What a subscriber whose next batch is `cursor` gets now: the batches from it on, or a
        snapshot (module docstring); the caller's next cursor is the last one's number + 1."""
        with self._lock:
            self._seal()
            oldest = self._ring[0].seq if self._ring else self._last + 1
            if cursor and oldest <= cursor <= self._last + 1:
                batches = list(itertools.islice(self._ring, cursor - oldest, None))  # numbers have no gap
                live = None
            else:
                batches, live, at = [], list(self._live.items()), self._last
        if live is not None:
            return self._snapshot(live, at)
        return [self._batch(b) for b in batches]

    # ---- protos ----
    def _batch(self, b: _Batch) -> cpb.KvEventBatch:
        events = []
        for e in b.events:
            if isinstance(e, _Stored):
                events.append(cpb.KvCacheEvent(event_id=e.event_id, stored=self._stored(e.parent, e.blocks)))
            else:
                events.append(cpb.KvCacheEvent(event_id=e.event_id, removed=cpb.KvBlocksRemoved(block_hashes=e.hashes)))
        return cpb.KvEventBatch(sequence_number=b.seq, timestamp=b.timestamp, events=events)

    def _stored(self, parent: int, blocks: list[Block]) -> cpb.KvBlocksStored:
        out = cpb.KvBlocksStored(
            blocks=[cpb.KvBlock(block_hash=h, token_ids=t, block_size=self.page_size) for h, t in blocks]
        )
        if parent != ROOT:  # unset for a sequence's first page, as engines publish it
            out.parent_block_hash = parent
        return out

    def _snapshot(self, live: list[tuple[int, tuple[int, tuple[int, ...]]]], at: int) -> list[cpb.KvEventBatch]:
        """The cached pages as chunks numbered up to `at` (as many chunks as numbers allow)."""
        count = max(1, min(-(-len(live) // self.chunk_blocks), at))
        per = -(-len(live) // count)
        now, chunks = time.time(), []
        for i in range(count):
            events = [cpb.KvCacheEvent(cleared=cpb.KvCacheCleared())] if i == 0 else []
            events += self._chains(live[i * per : (i + 1) * per])
            chunk = cpb.KvSnapshotChunk(index=i, count=count, blocks=len(live), unknown_before=0)
            chunks.append(
                cpb.KvEventBatch(sequence_number=at - count + 1 + i, timestamp=now, events=events, snapshot=chunk)
            )
        return chunks

    def _chains(self, live: list[tuple[int, tuple[int, tuple[int, ...]]]]) -> list[cpb.KvCacheEvent]:
        """One stored event per run of pages each the child of the one before."""
        events: list[cpb.KvCacheEvent] = []
        run: list[Block] = []
        first_parent = prev = ROOT
        for h, (parent, tokens) in live:
            if run and parent != prev:
                events.append(cpb.KvCacheEvent(stored=self._stored(first_parent, run)))
                run = []
            if not run:
                first_parent = parent
            run.append((h, tokens))
            prev = h
        if run:
            events.append(cpb.KvCacheEvent(stored=self._stored(first_parent, run)))
        return events


async def subscribe(
    log: KvEventLog, start: int, interval: float, stop: asyncio.Event | None = None
) -> AsyncIterator[cpb.KvEventBatch]:
    """One subscriber's stream: batches from `start` (or a snapshot), then new ones every
    `interval` seconds, until `stop` is set (the node shuts down) or the caller goes away."""
    cursor = start
    while True:
        for batch in log.read(cursor):
            yield batch
            cursor = batch.sequence_number + 1
        if stop is None:
            await asyncio.sleep(interval)
            continue
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            continue
        return
