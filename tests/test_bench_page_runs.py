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


def test_a_full_prefix_cache_keeps_pd_destinations_one_run_only_with_whole_runs() -> None:
    from bench.page_runs import simulate_full_cache

    shortfall, cached_a = simulate_full_cache(False, 8192, seed=1)
    whole, cached_b = simulate_full_cache(True, 8192, seed=1)
    late = len(whole) // 3  # once the pool is full
    assert max(whole[late:]) == 1 and sum(shortfall[late:]) / len(shortfall[late:]) > 10
    assert 0 < cached_b <= cached_a  # what the extra eviction costs the cache
