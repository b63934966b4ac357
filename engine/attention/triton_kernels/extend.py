"""Flash attention for several queries per request (prefill, chunked prefill, verify, draft steps).

One program per (request, kv head, block of query rows). Query rows pack (token, head of the kv
group) pairs, so one K/V tile serves every query head of the group: a 4:1 GQA verify window of
8 tokens fills a 32-row tile, and a long prefill reads each K/V tile once per group. Keys come
from the paged pool through the request table (this forward's K/V is stored there first).
Key tiles below the block's first query position are visible to every row and skip masking;
tiles past its last query position are skipped (causal). A tree mask replaces causality on each
request's last W keys; keys before that window stay visible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.common import TileConfig, dot_in_fp32, dot_precision
from engine.attention.triton_kernels.tile import attend_range


@triton.jit
def _extend_kernel(
    q_ptr,
    o_ptr,
    k_cache,
    v_cache,
    req_to_token,
    req_slots,
    seq_lens,
    extend_lens,
    qo_indptr,
    tree_ptr,
    tree_width,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rt,
    stride_tb,
    stride_tq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    # the last query blocks see the most keys under causality: launch them first (shorter tail)
    mb = tl.num_programs(2) - 1 - tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    ext = tl.load(extend_lens + b)
    q_start = tl.load(qo_indptr + b)
    row = tl.load(req_slots + b)
    prefix = seq_len - ext

    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = r // GROUP
    row_ok = r < ext * GROUP
    heads = kvh * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    qpos = prefix + tok

    # key range of this block: [0, full_end) visible to every row, [full_end, kv_end) masked
    first_tok = (mb * BLOCK_M) // GROUP
    last_tok = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // GROUP, ext - 1)
    block_used = mb * BLOCK_M < ext * GROUP  # blocks past a short request's rows do nothing
    if HAS_TREE:
        # tree nodes sit in slot order, so a node may see a later slot of the window
        kv_end = seq_len
        full_end = tl.minimum(prefix + first_tok + 1, seq_len - tree_width)
    else:
        kv_end = tl.minimum(prefix + last_tok + 1, seq_len)
        full_end = prefix + first_tok + 1
    kv_end = tl.where(block_used, kv_end, 0)
    full_end = tl.minimum(tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N, kv_end)
    tree_ptr += b * stride_tb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = attend_range(
        q,
        m_i,
        l_i,
        acc,
        k_cache,
        v_cache,
        row,
        kvh,
        0,
        full_end,
        kv_end,
        qpos,
        tok,
        row_ok,
        seq_len,
        tree_ptr,
        tree_width,
        req_to_token,
        stride_rt,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_tq,
        scale_log2,
        d,
        d_ok,
        BLOCK_N,
        HAS_TREE,
        DOT_PRECISION,
    )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend: int,
    tree_mask: torch.Tensor | None,
    scale: float,
    cfg: TileConfig,
    out: torch.Tensor,
) -> torch.Tensor:
    """q, out: (tokens, heads, dim) packed by request; tree_mask: (bs, >=max_extend, W) uint8.

    `max_extend` (a host value, an upper bound of extend_lens) sizes the grid.
    """
    bs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    has_tree = tree_mask is not None
    tree = tree_mask if has_tree else q  # any pointer: never read without a tree
    tree_width = tree_mask.shape[2] if has_tree else 0
    grid = (bs, kv_heads, triton.cdiv(max_extend * group, cfg.block_m))
    _extend_kernel[grid](
        q,
        out,
        k_cache,
        v_cache,
        req_to_token,
        req_slots,
        seq_lens,
        extend_lens,
        qo_indptr,
        tree,
        tree_width,
        scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        tree.stride(0) if has_tree else 0,
        tree.stride(1) if has_tree else 0,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HAS_TREE=has_tree,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_FP32=dot_in_fp32(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
