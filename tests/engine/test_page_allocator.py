"""The page allocator hands out contiguous runs (what keeps PD writes to few descriptors), merges
frees back into runs, and never loses or doubles a page under random churn."""

from __future__ import annotations

import random

import pytest

from engine.page_allocator import OutOfPages, PageAllocator


def _runs(pages: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(pages, pages[1:]) if b != a + 1)


def test_a_prompt_gets_one_run_after_decode_growth_interleaved_requests() -> None:
    a = PageAllocator(200)
    grown: dict[str, list[int]] = {"x": [], "y": [], "z": []}
    for _ in range(30):  # three decoding requests grow a page each, in turn
        for pages in grown.values():
            pages += a.alloc(1)
    a.free(grown.pop("y"))  # one finishes: its 30 pages are every third id
    prompt = a.alloc(64)  # a PD destination: one run despite the holes
    assert _runs(prompt) == 1 and prompt == sorted(prompt)
    a.check()


def test_first_fit_then_longest_runs_and_frees_merge() -> None:
    a = PageAllocator(21)  # pages 1..20
    first, second, third = a.alloc(5), a.alloc(5), a.alloc(5)
    assert first == [1, 2, 3, 4, 5] and third == [11, 12, 13, 14, 15]
    a.free(first)
    a.free(third)
    assert a.num_free_runs == 2  # 1-5 and 11-20 (11-15 merged with 16-20)
    assert a.alloc(8) == list(range(11, 19))  # the lowest run that fits it whole
    assert a.alloc(6) == [1, 2, 3, 4, 5, 19]  # none fits: longest runs first, address order
    a.free(second)
    assert a.num_free_runs == 2 and a.num_free == 6
    a.check()


def test_errors_keep_the_books_straight() -> None:
    a = PageAllocator(5)
    pages = a.alloc(3)
    with pytest.raises(OutOfPages):
        a.alloc(2)
    with pytest.raises(RuntimeError, match="double free or foreign page 4"):
        a.free([4])
    a.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(pages[:1])
    assert a.alloc(0) == [] and a.num_free == 4
    a.check()


def test_random_churn_never_loses_a_page() -> None:
    rng = random.Random(0)
    a = PageAllocator(300)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.45 or a.num_free < 40):
            a.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(a.alloc(rng.choice([1, 1, 1, 2, 7, 33])))
        assert len({p for h in held for p in h}) == sum(len(h) for h in held) == a.num_used
    a.check()
    for h in held:
        a.free(h)
    assert a.num_free_runs == 1 and a.num_free == 299
    a.check()


def test_longest_run_is_the_largest_free_run() -> None:
    a = PageAllocator(11)  # pages 1..10
    assert a.longest_run == 10
    taken = a.alloc(10)
    assert a.longest_run == 0
    a.free([taken[1], taken[2], taken[6]])
    assert a.longest_run == 2
