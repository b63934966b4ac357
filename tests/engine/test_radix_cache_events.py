"""The radix cache's listener: each page it gains or drops is reported once, by its chained hash,
parents before children; a listener's replayed view always equals the tree."""

from __future__ import annotations

import random

from common.prefix_hash import ROOT, block_hash, chain_hashes
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache

PS = 4


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.live: dict[int, int] = {}  # hash -> parent hash

    def stored(self, parent: int, blocks: list[tuple[int, tuple[int, ...]]]) -> None:
        self.events.append(("stored", parent, [h for h, _ in blocks]))
        for h, tokens in blocks:
            assert len(tokens) == PS
            assert parent == ROOT or parent in self.live, "a child before its parent"
            assert h not in self.live, "stored twice"
            self.live[h] = parent
            parent = h

    def removed(self, hashes: list[int]) -> None:
        self.events.append(("removed", hashes))
        for h in hashes:
            assert h in self.live and h not in self.live.values(), "removed twice, or before a child"
            del self.live[h]


def _all_hashes(c: RadixCache) -> set[int]:
    out, stack = set(), list(c.root.children.values())
    while stack:
        n = stack.pop()
        out.add(n.hash)
        stack.extend(n.children.values())
    return out


def test_insert_reports_the_new_chain_and_evict_the_dropped_pages():
    c, rec = RadixCache(PS, lambda pages: None), Recorder()
    c.set_listener(rec)
    a = list(range(1, 13))  # three pages
    c.insert(a, [1, 2, 3], 12)
    h = chain_hashes(a, PS)
    assert rec.events == [("stored", ROOT, h)]
    b = a[:4] + [9, 9, 9, 9]  # shares the first page only
    c.insert(b, [4, 5], 8)
    assert rec.events[-1] == ("stored", h[0], [block_hash(h[0], [9, 9, 9, 9])])
    c.insert(a, [6, 7, 8], 12)  # nothing new: no event
    assert len(rec.events) == 2
    c.evict(1)
    assert rec.events[-1][0] == "removed" and len(rec.events[-1][1]) == 1
    c.clear()
    assert rec.live == {} and c.num_pages == 0


def test_a_late_listener_hears_of_the_cached_pages_first():
    c = RadixCache(PS, lambda pages: None)
    c.insert(list(range(1, 13)), [1, 2, 3], 12)
    c.insert(list(range(1, 5)) + [7] * 8, [4, 5, 6], 12)
    rec = Recorder()
    c.set_listener(rec)  # asserts parents come first
    assert set(rec.live) == _all_hashes(c) and len(rec.live) == 5


def test_a_random_walk_keeps_the_listeners_view_equal_to_the_tree():
    rng = random.Random(1)
    pool = PageAllocator(120)
    c, rec = RadixCache(PS, pool.free, shift=1), Recorder()
    c.set_listener(rec)
    running: list[tuple[list[int], list[int], object]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.45 and len(running) < 10:
            tokens = [rng.choice([1, 2, 3]) for _ in range(rng.randrange(1, 30))]
            m = c.match(tokens, limit=len(tokens) - 1)
            need = -(-len(tokens) // PS) - len(m)
            if need > pool.num_free:
                c.evict(need - pool.num_free)
            if need > pool.num_free:
                continue
            c.lock(m)
            running.append((tokens, m.pages + pool.alloc(need), m))
        elif op < 0.85 and running:
            tokens, pages, m = running.pop(rng.randrange(len(running)))
            pool.free(c.insert(tokens, pages, len(tokens)).to_free)
            c.unlock(m)
        else:
            c.evict(rng.randrange(1, 8))
        c.check()
        assert set(rec.live) == _all_hashes(c)
