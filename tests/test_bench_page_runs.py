"""The page-run simulation runs and shows what the allocator is for: one run per PD destination
where a LIFO free list scatters them."""

from __future__ import annotations


def test_run_aware_destinations_stay_one_run_where_lifo_scatters() -> None:
    from bench.page_runs import LifoPages, simulate
    from engine.page_allocator import PageAllocator

    *lifo, _ = simulate(LifoPages(8192))
    *ours, held = simulate(PageAllocator(8192))
    assert max(ours[48:]) == 1 and sum(lifo[48:]) / len(lifo[48:]) > 10
    assert 0 < held < 8192
