"""Online softmax over tiles of paged keys, shared by the split-K and extend kernels.

Rows are (query token, query head) pairs of one kv head; keys are read through the request
table. MASKED applies causality, the tree window and the key range; unmasked tiles are those
every row may fully see, which skips the mask arithmetic on most of a long context.
`attend_range` walks a key range as unmasked tiles up to `full_end`, then masked ones.
"""

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    k_cache,
    v_cache,
    row,
    kvh,
    n0,
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
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pos = n0 + tl.arange(0, BLOCK_N)
    n_ok = pos < kv_end
    slot = tl.load(req_to_token + row * stride_rt + pos, mask=n_ok, other=0)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_cache + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        visible = pos[None, :] <= qpos[:, None]
        if HAS_TREE:
            win_start = seq_len - tree_width
            in_win = pos >= win_start
            rel = tl.maximum(pos - win_start, 0)
            tmask = row_ok[:, None] & (in_win & n_ok)[None, :]
            tree = tl.load(tree_ptr + tok[:, None] * stride_tq + rel[None, :], mask=tmask, other=0)
            visible = tl.where(in_win[None, :], tree != 0, visible)
        visible = visible & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no visible key yet keeps m = -inf; shift by 0 instead to avoid inf - inf
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_range(
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
    BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys [start, kv_end): tiles before `full_end` (tile-aligned) skip the mask."""
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache,
            v_cache,
            row,
            kvh,
            n0,
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
            False,
            HAS_TREE,
            DOT_PRECISION,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q,
            m_i,
            l_i,
            acc,
            k_cache,
            v_cache,
            row,
            kvh,
            n0,
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
            True,
            HAS_TREE,
            DOT_PRECISION,
        )
    return m_i, l_i, acc
