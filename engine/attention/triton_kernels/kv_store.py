"""Scatter new K and V rows into the paged pool at their token slots, both in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.pdl import pdl_launch, pdl_sync


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    loc_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    stride_vct,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    tok = tl.program_id(0)
    loc = tl.load(loc_ptr + tok)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    # the pool may hold another dtype than the activations: cast on store
    tl.store(k_cache + loc * stride_ct + h[:, None] * stride_ch + d[None, :], k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(
        v_cache + loc * stride_vct + h[:, None] * stride_vch + d[None, :], v.to(v_cache.dtype.element_ty), mask=mask
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor) -> None:
    """k, v: (tokens, kv_heads, dim); caches: (slots, kv_heads, dim); loc: (tokens,) slots."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **pdl_launch(k),
    )
