"""Split-K flash-decoding for short query windows: decode, verify, draft steps.

Pass 1 runs one program per (request, kv head, split). Its rows pack every (query token, query
head) pair of the kv group (a decode step has 1 token, a verify window up to a few), so each K/V
tile is read once per group rather than once per query head: decode and verify are bound by
that bandwidth. The split count is a launch constant; each split's key range is derived on the
device from seq_lens, so the grid never depends on device values (CUDA graph safe). Pass 2
merges the splits' partial outputs by their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.common import dot_in_fp32, dot_precision
from engine.attention.triton_kernels.tile import attend_range
from engine.pdl import pdl_launch, pdl_sync


@triton.jit
def _split_kernel(
    q_ptr,
    k_cache,
    v_cache,
    mid_o,
    mid_lse,
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
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rt,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    stride_tb,
    stride_tq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    ext = tl.load(extend_lens + b)
    q_start = tl.load(qo_indptr + b)
    row = tl.load(req_slots + b)
    prefix = seq_len - ext

    r = tl.arange(0, BLOCK_M)
    tok = r // GROUP
    row_ok = r < ext * GROUP
    heads = kvh * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    out_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=out_mask, other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    qpos = prefix + tok

    # whole tiles per split (tile-aligned starts), so only a request's last tile is ragged
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    # keys before the window's first query (and before the tree window) are visible to every row
    full = prefix + 1
    if HAS_TREE:
        full = tl.minimum(full, seq_len - tree_width)
    full_end = tl.maximum(tl.minimum(tl.maximum(full, 0) // BLOCK_N * BLOCK_N, end), start)
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
        start,
        full_end,
        end,
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

    # a split that saw no visible key (a short request) reports lse = -inf: zero weight
    has = l_i > 0
    safe_l = tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log2(safe_l), float("-inf"))
    t = q_start + tok
    tl.store(
        mid_o + t[:, None] * stride_mt + heads[:, None] * stride_mh + split * stride_ms + d[None, :],
        acc / safe_l[:, None],
        mask=out_mask,
    )
    tl.store(mid_lse + t * stride_lt + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    mid_o,
    mid_lse,
    o_ptr,
    stride_ot,
    stride_oh,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    t = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < HEAD_DIM
    lse = tl.load(mid_lse + t * stride_lt + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        mid_o + t * stride_mt + head * stride_mh + s[:, None] * stride_ms + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + t * stride_ot + head * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class SplitConfig:
    num_splits: int
    block_m: int  # >= max_extend * group: one row tile holds a request's whole window
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


def split_kv_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float,
    cfg: SplitConfig,
    out: torch.Tensor,
) -> torch.Tensor:
    """q, out: (tokens, heads, dim) packed by request; caches: (slots, kv_heads, dim);
    tree_mask: (bs, >=max_extend, W) uint8 or None (causal)."""
    num_tokens, num_heads, head_dim = q.shape
    bs, kv_heads = seq_lens.shape[0], k_cache.shape[1]
    splits = cfg.num_splits
    # scratch shaped only by static values: the CUDA graph's memory pool can own it
    mid_o = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    has_tree = tree_mask is not None
    tree = tree_mask if has_tree else q  # any pointer: never read without a tree
    block_d = triton.next_power_of_2(head_dim)
    _split_kernel[(bs, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        mid_o,
        mid_lse,
        req_to_token,
        req_slots,
        seq_lens,
        extend_lens,
        qo_indptr,
        tree,
        tree_mask.shape[2] if has_tree else 0,
        scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        tree.stride(0) if has_tree else 0,
        tree.stride(1) if has_tree else 0,
        GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=splits,
        HAS_TREE=has_tree,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_FP32=dot_in_fp32(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(q),
    )
    _merge_kernel[(num_tokens, num_heads)](
        mid_o,
        mid_lse,
        out,
        out.stride(0),
        out.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        **pdl_launch(q),
    )
    return out
