"""KVPool's page-major layout: slot s of layer l lands at buffer[s // P, l, k|v, s % P], through
the pool's own store, the Triton store kernel, and the per-layer views attention reads."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kv_cache import KVPool

LAYERS, PAGES, PAGE, HEADS, DIM = 3, 7, 4, 2, 8
SLOTS = [4, 5, 7, 13, 22, 27, 8]  # pages 1, 1, 1, 3, 5, 6, 2: in and across pages, out of order


def _pool(device: str = "cpu") -> KVPool:
    return KVPool(LAYERS, PAGES, PAGE, HEADS, DIM, torch.float32, device)


def _rows(seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(len(SLOTS), HEADS, DIM, generator=g) for _ in range(2))
    return k.to(device), v.to(device)


def _check_placement(pool: KVPool, written: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every written (layer, slot) sits at buffer[slot // P, layer, kv, slot % P]; nothing else."""
    expect = torch.zeros_like(pool.buffer)
    for layer, (k, v) in written.items():
        for i, s in enumerate(SLOTS):
            assert torch.equal(pool.buffer[s // PAGE, layer, 0, s % PAGE], k[i])
            assert torch.equal(pool.buffer[s // PAGE, layer, 1, s % PAGE], v[i])
            expect[s // PAGE, layer, 0, s % PAGE] = k[i]
            expect[s // PAGE, layer, 1, s % PAGE] = v[i]
    assert torch.equal(pool.buffer, expect)


def test_store_k_v_round_trip() -> None:
    pool = _pool()
    assert pool.buffer.shape == (PAGES, LAYERS, 2, PAGE, HEADS, DIM) and pool.num_pages == PAGES
    assert pool.page_bytes == LAYERS * 2 * PAGE * HEADS * DIM * 4
    assert pool.buffer[1].data_ptr() - pool.buffer[0].data_ptr() == pool.page_bytes  # pages abut
    loc = torch.tensor(SLOTS)
    written = {}
    for layer in (0, 2):
        k, v = _rows(layer)
        pool.store(layer, loc, k, v)
        written[layer] = (k, v)
    _check_placement(pool, written)
    for layer in range(LAYERS):
        kv = pool.k(layer), pool.v(layer)
        for view, which in zip(kv, (0, 1)):  # views, not copies, shaped (pages, P, heads, dim)
            assert view.shape == (PAGES, PAGE, HEADS, DIM)
            assert view.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
            assert view.stride() == pool.buffer[:, layer, which].stride()
        if layer in written:  # read back the way the torch backend gathers slots
            slots = loc.view(1, -1)
            assert torch.equal(kv[0][slots // PAGE, slots % PAGE][0], written[layer][0])
            assert torch.equal(kv[1][slots // PAGE, slots % PAGE][0], written[layer][1])
    pool.k(1)[3, 2] = 7.0  # a write through a view reaches the buffer
    assert bool((pool.buffer[3, 1, 0, 2] == 7.0).all())


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_triton_store_kernel_places_slots_like_the_pool() -> None:
    from engine.attention.triton_kernels.kv_store import store_kv

    device = "cpu" if INTERPRET else "cuda"
    pool, ref = _pool(device), _pool(device)
    loc = torch.tensor(SLOTS, device=device)
    written = {}
    for layer in (1, 2):
        k, v = _rows(10 + layer, device)
        store_kv(k, v, pool.k(layer), pool.v(layer), loc)
        ref.store(layer, loc, k, v)
        written[layer] = (k, v)
    assert torch.equal(pool.buffer, ref.buffer)
    _check_placement(pool, written)
