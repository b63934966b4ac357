"""engine.kv_transfer.layout: one region per page-major pool, page-run coalescing, descriptors."""

from __future__ import annotations

from engine.kv_transfer import MemoryLayout, Region, coalesce_runs, kv_regions, page_descs, run_descs
from engine.kv_transfer.wire import layout_from_proto, layout_to_proto
from tests.engine.kv_transfer_kit import SMALL, make_pools

MIB = 1 << 20


def test_one_region_per_pool_covering_whole_pages() -> None:
    pools = make_pools(SMALL, fill=True)
    regions = kv_regions(pools)
    assert len(regions) == len(pools)
    for r, pool in zip(regions, pools):
        size = pool.buffer.element_size()
        assert r.addr == pool.buffer.data_ptr() and r.count == pool.num_pages == 12
        assert r.item_bytes == pool.page_bytes == (pool.num_layers * 2 * pool.page_size
                                                   * pool.num_kv_heads * pool.head_dim * size)
        for page in (0, 5, 11):
            lo, hi = r.addr + page * r.item_bytes, r.addr + (page + 1) * r.item_bytes
            assert pool.buffer[page].data_ptr() == lo  # item `page` is exactly buffer[page]
            for layer in range(pool.num_layers):  # and holds every layer's K and V of it
                for view in (pool.k(layer)[page], pool.v(layer)[page]):
                    start = view.data_ptr()
                    assert lo <= start and start + view.numel() * size <= hi
    assert regions[0].item_bytes == 1024 and regions[1].item_bytes == 512


def test_coalescing_and_single_page_runs() -> None:
    regions = kv_regions(make_pools(SMALL, fill=False))
    s, d, n = coalesce_runs([3, 4, 5, 9, 10], [7, 8, 2, 11, 12])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([3, 5, 9], [7, 2, 11], [2, 1, 2])
    ones = run_descs(regions, *coalesce_runs([1, 5], [1, 5])[0::2])
    assert [tuple(map(int, x)) for x in ones] == page_descs(regions, [1, 5])
    s, _, n = coalesce_runs([2, 3, 4], [5, 6, 7])
    whole = run_descs(regions, s, n)  # a short run: one descriptor per pool, all its pages
    assert [tuple(map(int, x)) for x in whole] == [(r.addr + 2 * r.item_bytes, 3 * r.item_bytes, 0)
                                                   for r in regions]


def test_one_region_per_pool_layout_round_trips_the_wire() -> None:
    regions = kv_regions(make_pools(SMALL, fill=False))
    layout = MemoryLayout(kv=regions, aux=Region(4096, 256, 8), mem_type="DRAM", aux_mem_type="DRAM")
    back = layout_from_proto(layout_to_proto(layout))
    assert back == layout and len(back.kv) == 2 and layout.compatible_with(back) is None
    big = MemoryLayout(kv=(Region(1 << 47, 2 * MIB, 70_000, 3),), aux=Region(1, 64, 2, 3))
    assert layout_from_proto(layout_to_proto(big)) == big  # 140 GB region: 64-bit fields
