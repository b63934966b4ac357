"""The radix cache: match, insert, evict, references, EAGLE's shift; a random walk of operations
never frees a referenced page and the page accounting always adds up."""

from __future__ import annotations

import random

import pytest

from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache

PS = 4


def cache(shift: int = 0) -> tuple[RadixCache, list[int]]:
    freed: list[int] = []
    return RadixCache(PS, freed.extend, shift=shift), freed


def test_match_takes_whole_pages_of_the_longest_cached_prefix():
    c, freed = cache()
    seq = list(range(100, 111))  # 11 tokens: two whole pages and a partial one
    assert c.insert(seq, [7, 8, 9], len(seq)).to_free == [9]  # the partial page is not cached
    assert c.num_pages == 2 and c.num_evictable == 2
    assert c.match(seq).pages == [7, 8]
    assert c.match(seq[:8] + [0, 0]).pages == [7, 8]
    assert c.match(seq, limit=7).pages == [7]  # at most 7 tokens: one page
    assert c.match(seq[:3]).pages == []
    assert c.match([100, 101, 102, 0] + seq[4:]).pages == []  # the first page differs
    c.check()


def test_branches_share_their_common_pages_and_duplicates_come_back():
    c, _ = cache()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 9, 9, 9, 9]
    assert c.insert(a, [10, 11], 8).to_free == []
    # b computed its first page again (it ran beside a): the tree keeps its own copy
    assert c.insert(b, [20, 21], 8).to_free == [20]
    assert c.match(b).pages == [10, 21] and c.num_pages == 3
    c.check()


def test_referenced_pages_are_never_evicted_and_lru_goes_first():
    c, freed = cache()
    old, new = [1] * 8, [2] * 8
    c.insert(old, [10, 11], 8)
    c.insert(new, [20, 21], 8)
    held = c.match(new)
    c.lock(held)
    assert c.num_evictable == 2
    assert c.evict(10) == 2 and sorted(freed) == [10, 11]  # only the unreferenced branch
    c.unlock(held)
    c.match(new)  # touched
    c.insert([3] * 4, [30], 4)
    assert c.evict(1) == 1 and freed[-1] == 21  # the leaf used least recently: new tail, not [3]
    c.check()


def test_lru_order_across_branches():
    c, freed = cache()
    c.insert([1] * 4, [10], 4)
    c.insert([2] * 4, [20], 4)
    c.match([1] * 4 + [0])  # [1]'s page used last
    c.evict(1)
    assert freed == [20]


def test_unlocking_more_than_locked_is_an_error():
    c, _ = cache()
    c.insert([1] * 4, [10], 4)
    m = c.match([1] * 4)
    c.lock(m)
    c.unlock(m)
    with pytest.raises(RuntimeError, match="unlocked more often"):
        c.unlock(m)


def test_with_a_shift_a_page_is_reused_only_before_the_same_next_token():
    c, _ = cache(shift=1)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    c.insert(seq, [10, 11, 12], 9)  # page 11's last draft position saw token 9
    assert c.match(seq).pages == [10, 11]
    assert c.match(seq[:8] + [0]).pages == [10]  # another continuation: page 11's last draft KV is not ours
    assert c.match(seq[:8]).pages == [10]  # no token after it: the same
    # a sequence that ends at the boundary leaves no next token: that page is not cached at all
    d, _ = cache(shift=1)
    assert d.insert(seq[:8], [10, 11], 8).to_free == [11]
    assert d.match(seq).pages == [10]
    assert d.insert(seq, [20, 21, 22], 9).to_free == [20, 22]  # page 0 held already; page 2 partial
    assert d.match(seq).pages == [10, 21]
    d.check()


def test_with_a_shift_each_continuation_of_a_page_is_its_own_sibling():
    """A chat's previous turn continued a page with the reply as generated; the next turn's prompt
    continues it with the reply as sent back (re-tokenized). Both copies are kept, and everything
    cached after the second stays reachable: the next turns match their whole history."""
    c, freed = cache(shift=1)
    history = [1] * 4 + [2] * 4  # two pages of prompt
    generated, resent = [7, 7, 7, 7, 7], [8, 8, 8, 8, 8]
    c.insert(history + generated, [10, 11, 12, 13], 13)  # turn 1 ends: prompt + the reply it generated
    turn2 = history + resent + [3] * 3  # the reply as the client sent it, then a new message
    assert c.match(turn2).pages == [10]  # page 11 was computed before token 7, this one has 8
    c.insert(turn2 + [9] * 4, [10, 21, 22, 23, 24], 16)
    assert c.match(turn2 + [9] * 4 + [5]).pages == [10, 21, 22, 23]  # turn 3: all of turn 2's pages
    assert c.match(history + generated).pages == [10, 11, 12]  # turn 1's copy still serves its continuation
    c.check()
    # the siblings share their event hash: announced once, withdrawn with the last copy
    events: list[tuple[str, list[int]]] = []

    class Recorder:
        def stored(self, parent: int, blocks: list[tuple[int, tuple[int, ...]]]) -> None:
            events.append(("stored", [h for h, _ in blocks]))

        def removed(self, hashes: list[int]) -> None:
            events.append(("removed", hashes))

    e, _ = cache(shift=1)
    e.set_listener(Recorder())
    e.insert(history + generated, [10, 11, 12], 12)
    e.insert(history + resent, [10, 21, 22], 12)
    page1 = e.match(history + generated).nodes[1].hash
    assert [h for kind, hs in events if kind == "stored" for h in hs].count(page1) == 1
    removed = lambda: [h for kind, hs in events if kind == "removed" for h in hs]  # noqa: E731
    e.evict(3)  # both copies' third pages, then one copy of page 1
    assert page1 not in removed()  # the other copy is left
    e.evict(1)
    assert removed().count(page1) == 1
    e.check()


def test_a_random_walk_never_frees_a_referenced_page_and_accounting_adds_up():
    rng = random.Random(0)
    pool = PageAllocator(200)
    c = RadixCache(PS, pool.free, shift=1)
    running: list[tuple[list[int], list[int], object]] = []  # (tokens, own pages, locked match)
    vocab = [1, 2, 3]  # few tokens: many shared prefixes
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and len(running) < 12:  # admit: match, lock, allocate the rest
            tokens = [rng.choice(vocab) for _ in range(rng.randrange(1, 30))]
            m = c.match(tokens, limit=len(tokens) - 1)
            need = -(-len(tokens) // PS) - len(m)
            if need > pool.num_free:
                c.evict(need - pool.num_free)
            if need > pool.num_free:
                continue
            c.lock(m)
            running.append((tokens, m.pages + pool.alloc(need), m))
        elif op < 0.85 and running:  # finish: insert, free what the tree did not adopt, unlock
            tokens, pages, m = running.pop(rng.randrange(len(running)))
            for p in c.insert(tokens, pages, len(tokens)).to_free:
                pool.free([p])
            c.unlock(m)
        else:
            for _ in range(rng.randrange(1, 8)):
                evict_one_least_recently_used(c)
        c.check()
        pool.check()
        held = {p for _, pages, _ in running for p in pages}
        cached = set(c.pages())
        # a page is free, cached, or held by a running request: never two of these at once
        # except cached pages that running requests read (their matched prefix)
        reading = {p for _, _, m in running for p in m.pages}
        assert reading <= cached
        assert not (held - reading) & cached
        assert pool.num_used == len(held | cached), step
    for tokens, pages, m in running:
        for p in c.insert(tokens, pages, len(tokens)).to_free:
            pool.free([p])
        c.unlock(m)
    c.clear()
    assert pool.num_used == 0 and c.num_pages == 0


def evict_one_least_recently_used(c: RadixCache) -> None:
    """Evict one page and check, against a walk of the whole tree, that it was an unreferenced
    leaf used least recently."""
    leaves = {n.page: n.last_used for n in c._leaves() if n.refs == 0}
    freed: list[int] = []
    free_pages, c.free_pages = c.free_pages, lambda pages: (freed.extend(pages), free_pages(pages))
    try:
        assert c.evict(1) == (1 if leaves else 0)
    finally:
        c.free_pages = free_pages
    if leaves:
        assert leaves[freed[0]] == min(leaves.values())


def test_eviction_does_not_walk_the_tree():
    """A full pool evicts on almost every page a decode step allocates: each eviction must cost
    what it frees, not a walk of every cached page."""
    c, freed = cache()
    for s in range(50):
        c.insert([s + 10] + [0] * (8 * PS - 1), list(range(100 * s + 1, 100 * s + 9)), 8 * PS)
    c._leaves = lambda: pytest.fail("evict walked the tree")  # type: ignore[method-assign]
    for _ in range(120):
        assert c.evict(1) == 1
    assert len(freed) == 120 and c.num_pages == 400 - 120
