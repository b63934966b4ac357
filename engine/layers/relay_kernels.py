"""Fused Triton kernels for a captured decode step's relay traffic (engine/relay_step.py).

A graph-captured decode step reads its inputs from the FutureMap and writes its outputs back;
done with torch ops that is ~25 small kernels (gathers, the sentinel guard, the context's index
arithmetic, scatters), which on a small target cost a few percent of the step. Here it is two:
one before the forward, one after. The torch ops in relay_step.py are the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "table_cols", "max_pos"])
def _resolve_decode_kernel(
    slots_ptr,
    lens_ptr,
    toks_ptr,
    table_ptr,
    table_stride,
    table_cols,
    max_pos,
    prefix_ptr,
    ids_ptr,
    pos_ptr,
    loc_ptr,
    seq_ptr,
    ok_ptr,
    n,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    live = offs < n
    slot = tl.load(slots_ptr + offs, mask=live, other=0)
    prefix = tl.load(lens_ptr + slot, mask=live, other=0)
    tok = tl.load(toks_ptr + slot, mask=live, other=0)
    # the FutureMap's guard: a real row holding the sentinel was never published or stashed
    bad = live & (slot != 0) & ((prefix < 1) | (tok < 0))
    col = tl.maximum(tl.minimum(prefix, table_cols - 1), 0)
    loc = tl.load(table_ptr + slot * table_stride + col, mask=live, other=0)
    pos = tl.minimum(prefix, max_pos) if CLAMP else prefix
    tl.store(prefix_ptr + offs, prefix, mask=live)
    tl.store(ids_ptr + offs, tok, mask=live)
    tl.store(pos_ptr + offs, pos, mask=live)
    tl.store(loc_ptr + offs, loc, mask=live)
    tl.store(seq_ptr + offs, prefix + 1, mask=live)
    tl.store(ok_ptr, tl.sum(bad.to(tl.int32), axis=0) == 0)


def resolve_decode(
    slots: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor, max_position: int | None
) -> tuple[torch.Tensor, ...]:
    """(prefix, input ids, positions, out_cache_loc, seq_lens, ok) of a one-token decode step."""
    n = int(slots.shape[0])
    dev = slots.device
    prefix, ids, pos, seq = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(4))
    loc = torch.empty(n, dtype=table.dtype, device=dev)
    ok = torch.empty((), dtype=torch.bool, device=dev)
    _resolve_decode_kernel[(1,)](
        slots,
        lens,
        tokens,
        table,
        table.stride(0),
        table.shape[1],
        -1 if max_position is None else max_position,
        prefix,
        ids,
        pos,
        loc,
        seq,
        ok,
        n,
        CLAMP=max_position is not None,
        BLOCK=max(16, triton.next_power_of_2(n)),
    )
    return prefix, ids, pos, loc, seq, ok


@triton.jit(do_not_specialize=["depth", "width"])
def _commit_decode_kernel(
    slots_ptr,
    prefix_ptr,
    tok_ptr,
    lens_ptr,
    toks_ptr,
    ring_tok_ptr,
    ring_feat_ptr,
    depth,
    ring_row_stride,
    ring_pos_stride,
    src0,
    src1,
    src2,
    s0,
    s1,
    s2,
    width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    chunk = tl.program_id(2)
    slot = tl.load(slots_ptr + row)
    prefix = tl.load(prefix_ptr + row)
    tok = tl.load(tok_ptr + row)
    at = prefix % depth
    if (part == 0) & (chunk == 0):
        real = slot != 0  # padding rows keep row 0 at zero
        tl.store(lens_ptr + slot, tl.where(real, prefix + 1, 0))
        tl.store(toks_ptr + slot, tl.where(real, tok, 0))
        tl.store(ring_tok_ptr + slot * depth + at, tok)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    live = offs < width
    if part == 0:
        v = tl.load(src0 + row * s0 + offs, mask=live)
    elif part == 1:
        v = tl.load(src1 + row * s1 + offs, mask=live)
    else:
        v = tl.load(src2 + row * s2 + offs, mask=live)
    dst = ring_feat_ptr + slot * ring_row_stride + at * ring_pos_stride + part * width + offs
    tl.store(dst, v.to(ring_feat_ptr.dtype.element_ty), mask=live)


def commit_decode(
    slots: torch.Tensor,
    prefix: torch.Tensor,
    tokens: torch.Tensor,
    lens: torch.Tensor,
    toks: torch.Tensor,
    ring_tokens: torch.Tensor,
    ring_feats: torch.Tensor,
    sources: list[torch.Tensor],
) -> None:
    """Publish prefix + 1, stash the new tokens and push (the sources side by side, token) into
    each request's ring at prefix mod depth; sources: 1 to 3 (rows, width) tensors."""
    if not 1 <= len(sources) <= 3:
        raise ValueError(f"1 to 3 feature sources, got {len(sources)}")
    width = int(sources[0].shape[1])
    src = [s if s.stride(-1) == 1 else s.contiguous() for s in sources]
    src += [src[0]] * (3 - len(src))
    block = min(1024, triton.next_power_of_2(width))
    grid = (int(slots.shape[0]), len(sources), triton.cdiv(width, block))
    _commit_decode_kernel[grid](
        slots,
        prefix,
        tokens,
        lens,
        toks,
        ring_tokens,
        ring_feats,
        ring_tokens.shape[1],
        ring_feats.stride(0),
        ring_feats.stride(1),
        src[0],
        src[1],
        src[2],
        src[0].stride(0),
        src[1].stride(0),
        src[2].stride(0),
        width,
        BLOCK=block,
    )
