"""Registered-memory layout of KV pools and the descriptor lists a page transfer needs.

A KVPool buffer is page-major, (pages, layers, 2, page_size, kv_heads, head_dim): one page (every
layer's K and V) is contiguous, so each pool is ONE Region whose items are whole pages
(`pool.page_bytes`), in pool order. Both sides list their regions in this order with equal item
sizes (MemoryLayout.compatible_with), which is what lets a page id on one side be matched item
for item with a page id on the other, and a run of consecutive pages be one byte range.

Descriptors are plain (addr, len, device_id) rows (numpy uint64, N x 3) - never pickled NIXL
objects - so they are safe to build from data that came over the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kv_cache import KVPool
from engine.kv_transfer.base import Region

# Largest descriptor a run is cut into: UCX moves one descriptor on one CUDA stream, so a 1 GiB
# run as one descriptor is slower than as 128 pieces of 8 MiB spread over its streams.
MAX_DESC_BYTES = 8 << 20


def tensor_mem_type(t: torch.Tensor) -> str:
    """NIXL memory kind of a torch tensor: VRAM on CUDA, DRAM otherwise."""
    return "VRAM" if t.is_cuda else "DRAM"


def kv_regions(pools: Sequence[KVPool]) -> tuple[Region, ...]:
    """One Region per pool, in pool order: `num_pages` items of one whole page each."""
    regions: list[Region] = []
    for pool in pools:
        buf = pool.buffer
        if not buf.is_contiguous():
            raise ValueError("a KV pool buffer must be contiguous to be registered")
        dev = max(buf.get_device(), 0)  # CPU tensors report -1; NIXL wants 0 for DRAM
        assert buf.numel() * buf.element_size() == pool.num_pages * pool.page_bytes
        regions.append(Region(addr=buf.data_ptr(), item_bytes=pool.page_bytes,
                              count=pool.num_pages, device_id=dev))
    return tuple(regions)


def page_descs(regions: Sequence[Region], pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """One descriptor per (region, page), region-major: the uncoalesced form of a page list."""
    return [(r.addr + p * r.item_bytes, r.item_bytes, r.device_id) for r in regions for p in pages]


def coalesce_runs(src_pages: Sequence[int], dst_pages: Sequence[int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_start, dst_start, length) of maximal runs where BOTH page lists step by +1.

    Coalescing only where both sides are consecutive keeps the i-th source byte aimed at the
    i-th destination byte; fewer, larger descriptors are what makes UCX/RDMA fast.
    """
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source pages vs {dst.size} destination pages")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    brk = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate(([0], np.nonzero(brk)[0] + 1))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths


def _pieces(starts: np.ndarray, lengths: np.ndarray, per_piece: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs cut into pieces of at most `per_piece` items, in run order: (piece starts, lengths)."""
    n = -(-lengths // per_piece)  # pieces per run
    run = np.repeat(np.arange(lengths.size), n)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # piece index within its run
    return starts[run] + k * per_piece, np.minimum(per_piece, lengths[run] - k * per_piece)


def run_descs(regions: Sequence[Region], starts: np.ndarray, lengths: np.ndarray,
              max_bytes: int | None = None) -> np.ndarray:
    """N x 3 uint64 (addr, len, dev) for every region and run, region-major, each run cut into
    pieces of at most `max_bytes` (default MAX_DESC_BYTES; whole items, at least one item per
    piece). Same order as `page_descs` when all runs have length 1. The cut depends only on the
    run lengths and each region's item size, which both sides share, so their lists pair up
    descriptor for descriptor.
    """
    max_bytes = MAX_DESC_BYTES if max_bytes is None else max_bytes  # read late: tests shrink it
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if not regions or starts.size == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    parts = []
    for r in regions:
        st, ln = _pieces(starts, lengths, max(1, max_bytes // r.item_bytes))
        out = np.empty((st.size, 3), dtype=np.uint64)
        out[:, 0] = np.uint64(r.addr) + st.astype(np.uint64) * np.uint64(r.item_bytes)
        out[:, 1] = ln.astype(np.uint64) * np.uint64(r.item_bytes)
        out[:, 2] = r.device_id
        parts.append(out)
    return np.concatenate(parts)


def paired_run_descs(src_regions: Sequence[Region], dst_regions: Sequence[Region],
                     src_starts: np.ndarray, dst_starts: np.ndarray, lengths: np.ndarray,
                     max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination descriptor lists of the same runs; ValueError unless they pair up
    (equal counts and equal lengths, descriptor by descriptor): a NIXL WRITE copies the i-th
    source descriptor to the i-th destination one."""
    src = run_descs(src_regions, src_starts, lengths, max_bytes)
    dst = run_descs(dst_regions, dst_starts, lengths, max_bytes)
    if src.shape != dst.shape or not np.array_equal(src[:, 1], dst[:, 1]):
        raise ValueError(f"source and destination descriptors do not pair up ({len(src)} vs "
                         f"{len(dst)}; region item sizes differ?)")
    return src, dst
