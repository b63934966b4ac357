"""Causal attention of prompt chunks over a paged prefix plus their own contiguous keys.

One program per (query head, block of query tokens, request). A chunk's own keys are this
forward's K/V, contiguous by token: they are read straight from the projection's output, not
through the request table, so each tile is one strided block the compiler can pipeline. Keys of
a cached prefix (an earlier chunk, a prefix-cache hit) come from the paged pool and are visible
to every row. Own-key tiles below the block's first query skip the mask; only the diagonal
tiles mask. Query heads of one kv group are adjacent programs, so each K/V tile is read from
memory once and from L2 by the group's other heads; for a short chunk over a long prefix those
re-reads bound the kernel (bench/RESULTS.md, prompt attention). Blocks are launched heaviest
first (the last query blocks see the most keys), which shortens the tail of a long prompt.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.common import TileConfig, dot_in_fp32, dot_precision


@triton.jit
def _softmax_step(q, kt, v, m_i, l_i, acc, visible, scale_log2, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile (kt: keys transposed, dim x keys) into the running (max, sum, output) of
    each row; every row has seen at least one visible key before or in this tile, so the max
    stays finite."""
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _keys(base, rows, stride, d, ok):
    """A key tile transposed (dim x keys) for Q K^T. Loading it as (dim, keys) directly ran no
    faster on an H200."""
    return tl.trans(tl.load(base + rows[:, None] * stride + d[None, :], mask=ok[:, None], other=0.0))


@triton.jit
def _prompt_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    k_cache,
    v_cache,
    req_to_token,
    req_slots,
    seq_lens,
    extend_lens,
    qo_indptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_ch,
    stride_rt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    ext = tl.load(extend_lens + b)
    m0 = mb * BLOCK_M
    if m0 >= ext:
        return
    prefix = tl.load(seq_lens + b) - ext
    kvh = h // GROUP
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < ext
    d = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None])
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # the cached prefix, through the request table: visible to every row
    slot_row = req_to_token + tl.load(req_slots + b) * stride_rt
    for n0 in range(0, prefix, BLOCK_N):
        pos = n0 + cols
        n_ok = pos < prefix
        slot = tl.load(slot_row + pos, mask=n_ok, other=0)
        k = _keys(k_cache + kvh * stride_ch, slot, stride_ct, d, n_ok)
        v = tl.load(v_cache + slot[:, None] * stride_ct + kvh * stride_ch + d[None, :], mask=n_ok[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(
            q, k.to(q.dtype), v.to(q.dtype), m_i, l_i, acc, n_ok[None, :], scale_log2, True, DOT_PRECISION
        )

    # the chunk's own keys: tiles below the block's first row are visible to every row
    k_base = k_ptr + q_start * stride_kt + kvh * stride_kh
    v_base = v_ptr + q_start * stride_vt + kvh * stride_vh
    for n0 in range(0, m0, BLOCK_N):
        k = _keys(k_base, n0 + cols, stride_kt, d, cols >= 0)
        v = tl.load(v_base + (n0 + cols)[:, None] * stride_vt + d[None, :])
        m_i, l_i, acc = _softmax_step(
            q, k.to(q.dtype), v.to(q.dtype), m_i, l_i, acc, row_ok[:, None], scale_log2, False, DOT_PRECISION
        )
    for n0 in range(m0, tl.minimum(m0 + BLOCK_M, ext), BLOCK_N):
        pos = n0 + cols
        n_ok = pos < ext
        k = _keys(k_base, pos, stride_kt, d, n_ok)
        v = tl.load(v_base + pos[:, None] * stride_vt + d[None, :], mask=n_ok[:, None], other=0.0)
        visible = (pos[None, :] <= rows[:, None]) & n_ok[None, :]
        m_i, l_i, acc = _softmax_step(
            q, k.to(q.dtype), v.to(q.dtype), m_i, l_i, acc, visible, scale_log2, True, DOT_PRECISION
        )

    out = acc / l_i[:, None]
    o = o_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def prompt_kernel_fits(head_dim: int) -> bool:
    """The kernel tiles the head dim whole (no masked lanes), so it must be a power of two; its
    tiles are sized for dims up to 128 (a 256-dim head's three stages of 64-key K/V tiles would
    fill an H100's shared memory), so wider heads keep the extend kernel."""
    return 16 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0


def prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend: int,
    scale: float,
    cfg: TileConfig,
    out: torch.Tensor,
) -> torch.Tensor:
    """q, out: (tokens, heads, dim); k, v: (tokens, kv heads, dim), this forward's keys, packed by
    request like q (any token and head strides, unit dim stride): request i's chunk is the
    extend_lens[i] rows from qo_indptr[i]. Its keys before the chunk are read from the pool.
    `max_extend` (host, an upper bound of extend_lens) sizes the grid."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    if not prompt_kernel_fits(head_dim) or cfg.block_m % cfg.block_n or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"prompt attention needs a power-of-two head dim of 16-128 ({head_dim}), block_n | block_m, one pool layout"
        )
    grid = (num_heads, triton.cdiv(max_extend, cfg.block_m), seq_lens.shape[0])
    _prompt_kernel[grid](
        q,
        k,
        v,
        out,
        k_cache,
        v_cache,
        req_to_token,
        req_slots,
        seq_lens,
        extend_lens,
        qo_indptr,
        scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_FP32=dot_in_fp32(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
