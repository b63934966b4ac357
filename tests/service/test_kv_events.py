"""The KV event log: numbered batches with no gap, resuming from a cursor, a snapshot for a new,
late or lost subscriber (parents first, numbered so live batches follow), a bounded ring."""

from __future__ import annotations

import asyncio

from common.prefix_hash import ROOT, chain_hashes
from engine.radix_cache import RadixCache
from engine.service.kv_events import KvEventLog, subscribe

PS = 4


def _setup(**kw) -> tuple[RadixCache, KvEventLog]:
    c, log = RadixCache(PS, lambda pages: None), KvEventLog(PS, **kw)
    c.set_listener(log)
    return c, log


def _replay(batches, into: set[int] | None = None) -> set[int]:
    """A subscriber's view: the hashes the events leave cached."""
    view = set() if into is None else into
    for b in batches:
        for e in b.events:
            kind = e.WhichOneof("data")
            if kind == "cleared":
                view.clear()
            elif kind == "stored":
                assert not e.stored.HasField("parent_block_hash") or e.stored.parent_block_hash in view
                view.update(blk.block_hash for blk in e.stored.blocks)
            else:
                view.difference_update(e.removed.block_hashes)
    return view


def _cached(c: RadixCache) -> set[int]:
    out, stack = set(), list(c.root.children.values())
    while stack:
        n = stack.pop()
        out.add(n.hash)
        stack.extend(n.children.values())
    return out


def test_batches_are_numbered_without_gaps_and_carry_the_pages():
    c, log = _setup()
    a = list(range(1, 13))
    c.insert(a, [1, 2, 3], 12)
    first = log.read(1)
    assert [b.sequence_number for b in first] == [1] and not first[0].HasField("snapshot")
    (event,) = first[0].events
    stored = event.stored
    assert [b.block_hash for b in stored.blocks] == chain_hashes(a, PS)
    assert [list(b.token_ids) for b in stored.blocks] == [a[:4], a[4:8], a[8:]]
    assert {b.block_size for b in stored.blocks} == {PS} and not stored.HasField("parent_block_hash")
    assert event.event_id > 0
    assert log.read(2) == []  # nothing new
    c.insert(a[:4] + [9] * 4, [4, 5], 8)
    c.evict(2)
    second = log.read(2)
    assert [b.sequence_number for b in second] == [2]
    assert second[0].events[0].stored.parent_block_hash == chain_hashes(a, PS)[0]
    assert second[0].events[1].WhichOneof("data") == "removed"
    assert _replay(first + second) == _cached(c)
    assert log.read(1) == first + second  # resuming from an older cursor the ring still holds


def test_a_new_or_lost_subscriber_gets_a_snapshot_and_then_live_batches():
    c, log = _setup(chunk_blocks=3)
    empty = log.read(0)
    assert len(empty) == 1 and empty[0].sequence_number == 0 and empty[0].snapshot.count == 1
    assert [e.WhichOneof("data") for e in empty[0].events] == ["cleared"]
    for i in range(4):  # four batches: 2 + 3 + 4 + 5 pages, branches off the first
        c.insert([7] * 4 + [i] * 4 * (i + 1), list(range(10 * i, 10 * i + 6)), 4 + 4 * (i + 1))
        log.seal()
    assert log.last_sequence == 4 and log.cached_blocks() == 11 == len(_cached(c))
    snap = log.read(0)
    # 11 pages in chunks of 3 would need 4 numbers: 4 chunks numbered 1..4
    assert [b.sequence_number for b in snap] == [1, 2, 3, 4]
    assert [(b.snapshot.index, b.snapshot.count, b.snapshot.blocks) for b in snap] == [(i, 4, 11) for i in range(4)]
    assert snap[0].events[0].WhichOneof("data") == "cleared"
    assert all(e.event_id == 0 for b in snap for e in b.events)
    view = _replay(snap, {123})  # the cleared event drops what the subscriber knew
    assert view == _cached(c)
    c.evict(1)
    assert _replay(log.read(5), view) == _cached(c)  # live batches continue after the last chunk
    assert log.read(99)[0].HasField("snapshot")  # a cursor from a node's earlier life


def test_the_ring_is_bounded_and_an_overflowed_cursor_resyncs():
    c, log = _setup(max_events=6, max_pending=1000)
    for i in range(5):  # five batches of 2 pages each: the ring keeps the newest 3
        c.insert([i] * 8, [2 * i, 2 * i + 1], 8)
        log.seal()
    assert [b.sequence_number for b in log.read(3)] == [3, 4, 5]
    lost = log.read(2)
    assert lost[-1].sequence_number == 5 and all(b.HasField("snapshot") for b in lost)
    assert _replay(lost) == _cached(c)


def test_pending_events_are_sealed_when_nobody_reads():
    c, log = _setup(max_pending=4)
    for i in range(6):
        c.insert([i] * 8, [2 * i, 2 * i + 1], 8)  # 2 pages each: a batch every second insert
    assert log.last_sequence == 3


def test_the_stream_resumes_waits_for_new_batches_and_ends_on_stop():
    async def main() -> None:
        c, log = _setup()
        c.insert([1] * 8, [1, 2], 8)
        stop = asyncio.Event()
        got: list = []

        async def follow() -> None:
            async for b in subscribe(log, 0, 0.01, stop):
                got.append(b)

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.05)
        c.insert([1] * 4 + [2] * 4, [3, 4], 8)  # from another thread in a node; the lock covers it
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 1)
        assert got[0].HasField("snapshot") and got[0].sequence_number == 1
        assert [b.sequence_number for b in got[1:]] == [2]
        assert _replay(got) == _cached(c)
        assert ROOT not in _replay(got)

    asyncio.run(main())
