"""Registered-memory layout of KV pools and the descriptor lists a page transfer needs.

A KVPool buffer is (layers, 2, pages, page_size, kv_heads, head_dim), so every (layer, k|v) slab
is a contiguous array of equal pages: one Region per (pool, layer, k|v), in pool order, then
layer, then k before v. Both sides list their regions in this order, which is what lets a page
id on one side be matched item for item with a page id on the other.

Descriptors are plain (addr, len, device_id) rows (numpy uint64, N x 3) - never pickled NIXL
objects - so they are safe to build from data that came over the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kv_cache import KVPool
from engine.kv_transfer.base import Region


def tensor_mem_type(t: torch.Tensor) -> str:
    """NIXL memory kind of a torch tensor: VRAM on CUDA, DRAM otherwise."""
    return "VRAM" if t.is_cuda else "DRAM"


def kv_regions(pools: Sequence[KVPool]) -> tuple[Region, ...]:
    regions: list[Region] = []
    for pool in pools:
        buf = pool.buffer
        if not buf.is_contiguous():
            raise ValueError("a KV pool buffer must be contiguous to be registered")
        dev = max(buf.get_device(), 0)  # CPU tensors report -1; NIXL wants 0 for DRAM
        pages = buf.shape[2]
        for layer in range(buf.shape[0]):
            for kv in (0, 1):
                slab = buf[layer, kv]
                assert slab.numel() * slab.element_size() == pages * pool.page_bytes
                regions.append(Region(addr=slab.data_ptr(), item_bytes=pool.page_bytes, count=pages, device_id=dev))
    return tuple(regions)


def page_descs(regions: Sequence[Region], pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """One descriptor per (region, page), region-major: the uncoalesced form of a page list."""
    return [(r.addr + p * r.item_bytes, r.item_bytes, r.device_id) for r in regions for p in pages]


def page_runs(pages: Sequence[int]) -> int:
    """Runs of consecutive page ids in `pages` (0 for none): a write into them takes one copy per
    run and region when its source is contiguous."""
    return sum(1 for i, page in enumerate(pages) if i == 0 or page != pages[i - 1] + 1)


def coalesce_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def run_descs(regions: Sequence[Region], starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """N x 3 uint64 (addr, len, dev) for every region and run, region-major (same order as
    `page_descs` when all runs have length 1)."""
    if not regions or starts.size == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    addr = np.array([r.addr for r in regions], dtype=np.uint64)[:, None]
    item = np.array([r.item_bytes for r in regions], dtype=np.uint64)[:, None]
    dev = np.array([r.device_id for r in regions], dtype=np.uint64)[:, None]
    st = starts.astype(np.uint64)[None, :]
    ln = lengths.astype(np.uint64)[None, :]
    out = np.empty((len(regions), starts.size, 3), dtype=np.uint64)
    out[..., 0] = addr + st * item
    out[..., 1] = ln * item
    out[..., 2] = dev
    return out.reshape(-1, 3)
