"""engine.kv_transfer.layout: one region per page-major pool, page-run coalescing, and runs cut into
descriptors of at most MAX_DESC_BYTES that pair up source to destination."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv_transfer import (MAX_DESC_BYTES, MemoryLayout, Region, coalesce_runs, kv_regions,
                                page_descs, paired_run_descs, run_descs)
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


@pytest.mark.parametrize(("item", "pages", "want"), [
    (2 * MIB, 64, 16),     # 1K tokens of an 8B-shaped pool: 128 MiB -> 16 x 8 MiB
    (2 * MIB, 512, 128),   # 1 GiB -> 128 x 8 MiB
    (3 * MIB, 5, 3),       # 6 MiB pieces (whole pages): 15 MiB -> 6 + 6 + 3
    (10 * MIB, 3, 3),      # a page above the cap still goes whole, one per piece
    (2 * MIB, 4, 1),       # at most MAX_DESC_BYTES: one descriptor
])
def test_runs_split_into_capped_pieces(item: int, pages: int, want: int) -> None:
    src = (Region(addr=1 << 40, item_bytes=item, count=2048, device_id=1),)
    dst = (Region(addr=1 << 41, item_bytes=item, count=2048, device_id=1),)
    src_pages, dst_pages = list(range(7, 7 + pages)), list(range(100, 100 + pages))
    s0, d0, n = coalesce_runs(src_pages, dst_pages)
    local, remote = paired_run_descs(src, dst, s0, d0, n)
    piece = max(1, MAX_DESC_BYTES // item) * item
    assert len(local) == len(remote) == want == -(-pages * item // piece)
    assert np.array_equal(local[:, 1], remote[:, 1]) and set(local[:, 2].tolist()) == {1}
    assert all(int(x) <= max(MAX_DESC_BYTES, item) and int(x) % item == 0 for x in local[:, 1])
    for descs, region, first in ((local, src[0], 7), (remote, dst[0], 100)):
        # the pieces tile the run's byte range exactly, in order
        ends = descs[:, 0] + descs[:, 1]
        assert int(descs[0, 0]) == region.addr + first * item
        assert np.array_equal(descs[1:, 0], ends[:-1])
        assert int(ends[-1]) == region.addr + (first + pages) * item


def test_split_descriptors_pair_up_across_pools_and_runs() -> None:
    """Two pools (1 KiB and 512 B pages), runs of 6 and 1 pages, cap 1500 B: pool 0 goes a page
    per piece, pool 1 two; both sides list the same lengths in the same order."""
    regions = kv_regions(make_pools(SMALL, fill=False))
    peer = tuple(Region(r.addr + (1 << 30), r.item_bytes, r.count) for r in regions)
    s0, d0, n = coalesce_runs([1, 2, 3, 4, 5, 6, 9], [3, 4, 5, 6, 7, 8, 11])
    local, remote = paired_run_descs(regions, peer, s0, d0, n, max_bytes=1500)
    assert local[:, 1].tolist() == [1024] * 7 + [1024, 1024, 1024, 512]
    assert remote[:, 1].tolist() == local[:, 1].tolist()
    assert int(remote[0, 0]) == peer[0].addr + 3 * 1024 and int(remote[7, 0]) == peer[1].addr + 3 * 512
    assert len(paired_run_descs(regions, peer, s0, d0, n)[0]) == 2 * 2  # default cap: whole runs
    wrong = (peer[0], Region(peer[1].addr, 256, peer[1].count))  # a peer with other page bytes
    with pytest.raises(ValueError, match="do not pair up"):
        paired_run_descs(regions, wrong, s0, d0, n, max_bytes=1500)
    empty = paired_run_descs(regions, peer, *coalesce_runs([], []))
    assert empty[0].shape == empty[1].shape == (0, 3)


def test_one_region_per_pool_layout_round_trips_the_wire() -> None:
    regions = kv_regions(make_pools(SMALL, fill=False))
    layout = MemoryLayout(kv=regions, aux=Region(4096, 256, 8), mem_type="DRAM", aux_mem_type="DRAM")
    back = layout_from_proto(layout_to_proto(layout))
    assert back == layout and len(back.kv) == 2 and layout.compatible_with(back) is None
    big = MemoryLayout(kv=(Region(1 << 47, 2 * MIB, 70_000, 3),), aux=Region(1, 64, 2, 3))
    assert layout_from_proto(layout_to_proto(big)) == big  # 140 GB region: 64-bit fields
