"""Triton kernels for the elementwise layers: (residual add +) RMSNorm, rotary on q and k, SiLU*mul.

Each op is one launch with fp32 math and the same rounding points as the torch reference in
norm.py / rotary.py / activation.py, so both paths agree to the last bit or nearly so. Launchers
only read shapes and strides on the host (no syncs), so they can be captured in CUDA graphs.
Imported lazily (engine/layers/dispatch.py): `triton.jit` picks the interpreter when
TRITON_INTERPRET=1 is set at import time, which is how the CPU tests run these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.pdl import pdl_launch, pdl_sync

# Elements one program touches at most: enough to hide latency, small enough for registers.
_TILE = 4096


@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    heads,
    sx_t,
    sx_h,
    sr_t,
    so_t,
    so_h,
    sro_t,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    # A row is one (token, head) vector: heads == 1 for hidden states, > 1 for Qwen3's q/k norm.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < dim)[None, :]
    tok = (rows // heads).to(tl.int64)
    head = (rows % heads).to(tl.int64)
    x = tl.load(x_ptr + (tok * sx_t + head * sx_h)[:, None] + cols[None, :], mask=mask, other=0.0)
    in_dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (tok * sr_t)[:, None] + cols[None, :], mask=mask, other=0.0)
        # the new residual is rounded to the input dtype before the norm reads it, as in torch
        x = (x + r.to(tl.float32)).to(in_dtype)
        tl.store(res_out_ptr + (tok * sro_t)[:, None] + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    # HF rounding: normalised value cast to the input dtype, then scaled by the weight
    y = (x * rstd[:, None]).to(in_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    out = y * w[None, :]
    tl.store(out_ptr + (tok * so_t + head * so_h)[:, None] + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(elems: int) -> int:
    return 4 if elems <= 2048 else 8 if elems <= 8192 else 16


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x (tokens, dim) or (tokens, heads, dim).

    With `residual` (2-D only), normalises x + residual and also returns that sum.
    Returns (normed, new_residual or None); outputs are fresh contiguous tensors.
    """
    dim = x.shape[-1]
    x3 = x.unsqueeze(1) if x.dim() == 2 else x.reshape(-1, x.shape[-2], dim)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    tokens, heads = x3.shape[0], x3.shape[1]
    if residual is not None and x.dim() != 2:
        raise ValueError("the fused residual add takes (tokens, dim) hidden states")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    o3 = out.view(tokens, heads, dim)
    res_out, r2 = None, x3  # dummies when there is no residual (never read)
    if residual is not None:
        r2 = residual.reshape(tokens, dim)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(residual.shape, dtype=x.dtype, device=x.device)
    ro2 = res_out.view(tokens, dim) if res_out is not None else o3
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(64, _TILE // block_d))
    n_rows = tokens * heads
    if n_rows == 0:
        return out, res_out
    _rmsnorm_kernel[(triton.cdiv(n_rows, block_r),)](
        x3,
        r2,
        weight,
        o3,
        ro2,
        n_rows,
        heads,
        x3.stride(0),
        x3.stride(1),
        r2.stride(0),
        o3.stride(0),
        o3.stride(1),
        ro2.stride(0),
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=_num_warps(block_r * block_d),
        **pdl_launch(x),
    )
    return out, res_out


@triton.jit
def _rope_heads(src, dst, s_h, d_h, n_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < n_heads)[:, None] & (d < half)[None, :]
    src_off = h[:, None] * s_h + d[None, :]
    x1 = tl.load(src + src_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + src_off + half, mask=mask, other=0.0).to(tl.float32)
    dst_off = h[:, None] * d_h + d[None, :]
    # both halves are loaded before either is stored, so src == dst (in place) is safe
    tl.store(dst + dst_off, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + dst_off + half, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_tokens"])
def _rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    n_tokens,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sqo_t,
    sqo_h,
    sko_t,
    sko_h,
    s_cos,
    q_heads,
    k_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * s_cos + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * s_cos + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    _rope_heads(q_ptr + t * sq_t, qo_ptr + t * sqo_t, sq_h, sqo_h, q_heads, cos, sin, half, BLOCK_H, BLOCK_D)
    _rope_heads(k_ptr + t * sk_t, ko_ptr + t * sko_t, sk_h, sko_h, k_heads, cos, sin, half, BLOCK_H, BLOCK_D)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """The kernels index (token, head) by strides but need the head dim contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary on q (tokens, heads, dim) and k (tokens, kv_heads, dim) in one launch.

    cos/sin: (max_positions, dim // 2) float32 tables. In place writes back into q and k (which
    must then have a contiguous last dim); otherwise returns fresh contiguous tensors.
    """
    if inplace and (q.stride(-1) != 1 or k.stride(-1) != 1):
        raise ValueError("in-place rotary needs q and k with a contiguous last dim")
    q_in, k_in = _rows_view(q), _rows_view(k)
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n_tokens, half = q.shape[0], q.shape[-1] // 2
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    block_h = triton.next_power_of_2(max(q.shape[1], k.shape[1]))
    block_d = triton.next_power_of_2(half)
    if n_tokens > 0:
        _rope_kernel[(n_tokens,)](
            q_in,
            k_in,
            q_out,
            k_out,
            positions.contiguous(),
            cos,
            sin,
            n_tokens,
            q_in.stride(0),
            q_in.stride(1),
            k_in.stride(0),
            k_in.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos.stride(0),
            q.shape[1],
            k.shape[1],
            half,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=_num_warps(block_h * block_d),
            **pdl_launch(q),
        )
    return q_out, k_out


@triton.jit(do_not_specialize=["n_rows"])
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n_rows, sg, su, so, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    g32 = g.to(tl.float32)
    # torch rounds silu's result to the input dtype before the product; so do we
    act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)
    tl.store(o_ptr + row * so + cols, (act * u).to(o_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shaped (..., n) tensors (views of a fused gate_up are fine)."""
    n_cols = gate.shape[-1]
    g2 = gate.reshape(-1, n_cols)
    u2 = up.reshape(-1, n_cols)
    g2, u2 = _rows_view(g2), _rows_view(u2)
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    o2 = out.view(-1, n_cols)
    n_rows = g2.shape[0]
    block = min(1024, triton.next_power_of_2(n_cols))
    if n_rows > 0:
        _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            g2,
            u2,
            o2,
            n_rows,
            g2.stride(0),
            u2.stride(0),
            o2.stride(0),
            n_cols,
            BLOCK=block,
            num_warps=4,
            **pdl_launch(gate),
        )
    return out
