"""A node that moves KV (PD) takes a prompt's pages as one run when its cache is full: a KV write
costs a descriptor per run of pages, and evicting only the shortfall hands out the single pages
decode growth left behind. Nodes that move no KV evict only what they need."""

from __future__ import annotations

import random

from engine.kv_cache import RUN_EVICTION_FACTOR, WHOLE_RUN_MIN_PAGES, KVCacheConfig, KVCacheManager
from engine.kv_transfer.layout import page_runs

PS = 4


def full_cache(whole_runs: bool) -> KVCacheManager:
    """Pages 1..80 all cached, least recently used first: sequence A (prompt run 1-16, then every
    other page from 33 as it grew), then B (17-32, and the pages between A's)."""
    kv = KVCacheManager(KVCacheConfig(81, PS, 4, 256), "cpu")
    cache = kv.enable_prefix_cache(0)
    kv.whole_runs = whole_runs
    a, b = kv.alloc_pages(16), kv.alloc_pages(16)
    for _ in range(24):  # decode growth interleaves them
        a += kv.alloc_pages(1)
        b += kv.alloc_pages(1)
    assert a[:16] == list(range(1, 17)) and a[16:18] == [33, 35] and kv.allocator.num_free == 0
    rng = random.Random(0)
    for pages in (a, b):  # A finishes first: its pages are the least recently used
        tokens = [rng.randrange(1, 10**6) for _ in range(len(pages) * PS)]
        assert not cache.insert(tokens, pages, len(tokens)).to_free
    return kv


def test_a_prompt_on_a_transferring_node_gets_one_run_from_a_full_cache() -> None:
    kv = full_cache(whole_runs=True)
    pages = kv.alloc_pages(16)
    assert page_runs(pages) == 1  # A's prompt run, freed whole
    evicted = kv.cache.stats["evicted_pages"]  # type: ignore[union-attr]
    assert 16 < evicted <= 16 + RUN_EVICTION_FACTOR * 16  # beyond the shortfall, within the bound
    kv.allocator.free(pages)
    kv.check()


def test_without_it_only_the_shortfall_is_evicted_and_the_pages_scatter() -> None:
    kv = full_cache(whole_runs=False)
    pages = kv.alloc_pages(16)
    assert page_runs(pages) == 16  # A's growth pages, every other id
    assert kv.cache.stats["evicted_pages"] == 16  # type: ignore[union-attr]
    kv.allocator.free(pages)
    kv.check()


def test_decode_growth_evicts_only_the_pages_it_needs() -> None:
    kv = full_cache(whole_runs=True)
    assert len(kv.alloc_pages(1)) == 1 and kv.cache.stats["evicted_pages"] == 1  # type: ignore[union-attr]
    # a speculative step's few pages are growth too: no search for a run
    assert len(kv.alloc_pages(WHOLE_RUN_MIN_PAGES - 1)) == WHOLE_RUN_MIN_PAGES - 1
    assert kv.cache.stats["evicted_pages"] == WHOLE_RUN_MIN_PAGES  # type: ignore[union-attr]


def test_the_extra_eviction_is_bounded_when_no_run_can_form() -> None:
    """Every other page cached, the rest held by a running request: no eviction makes a run of
    two, so the allocation stops after its bound and takes single pages."""
    kv = KVCacheManager(KVCacheConfig(161, PS, 4, 512), "cpu")
    cache = kv.enable_prefix_cache(0)
    kv.whole_runs = True
    held, cached = [], []
    for _ in range(80):
        held += kv.alloc_pages(1)
        cached += kv.alloc_pages(1)
    tokens = list(range(1, len(cached) * PS + 1))
    assert not cache.insert(tokens, cached, len(tokens)).to_free
    n = WHOLE_RUN_MIN_PAGES
    pages = kv.alloc_pages(n)
    assert page_runs(pages) == n and cache.stats["evicted_pages"] == n + RUN_EVICTION_FACTOR * n
    kv.allocator.free(pages + held)
    kv.check()


def test_a_node_that_registers_its_kv_for_transfer_allocates_whole_runs(tmp_path) -> None:
    from engine.disagg import DisaggEngine
    from engine.engine import Engine, EngineConfig
    from engine.kv_transfer.endpoint import build_endpoint
    from fixtures.tiny_model import write_tiny_model

    eng = Engine(EngineConfig(str(write_tiny_model(tmp_path / "m"))))
    assert not eng.kv.whole_runs  # colocated: evicting beyond the need would only cost cache hits
    endpoint = build_endpoint(
        DisaggEngine(eng), kind="fake", role="decode", rows=3, spec_algorithm="NONE", draft_model_dir=None
    )
    try:
        assert eng.kv.whole_runs
    finally:
        endpoint.transport.close()
