"""Skinny GEMMs (a few activation rows times a large weight) as Triton kernels.

Batch-1 decode and small verify windows read every weight once per step and do almost no math,
so the step time is the weight bytes over the bandwidth a kernel reaches plus the gaps between
kernels. One activation row takes a GEMV that streams each program's weight rows with two tiles
in flight; under programmatic dependent launch (engine/pdl.py) it fetches its first weight tile
before waiting for the previous kernel, so the launch gap and the previous kernel's tail overlap
the weight stream. Two to MAX_ROWS rows take a tensor-core kernel (rows padded to 16) with a
pipelined K loop; both beat cuBLAS on these shapes (bench/RESULTS.md).
Accumulation is fp32; the output is rounded once, to the activation dtype. Imported lazily
(engine/layers/dispatch.py), like the other Triton layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.common import dot_in_fp32, dot_precision
from engine.pdl import pdl_launch, pdl_sync

# Largest activation row count taken here: beyond it cuBLAS's tensor-core GEMMs are as good.
MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per program
    block_k: int  # weight columns per tile
    num_warps: int
    num_stages: int = 1  # the tensor-core kernel's pipeline depth (the one-row kernel keeps two)


@triton.jit
def _row_tile(w_rows, k0, kk, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + (k0 + kk)[None, :])
    return tl.load(w_rows + (k0 + kk)[None, :], mask=(k0 + kk < K)[None, :], other=0.0)


@triton.jit
def _x_tile(x_ptr, k0, kk, K):
    """Columns [k0, k0 + BLOCK_K) of the one activation row, as a (1, BLOCK_K) fp32 tile."""
    cols = k0 + kk
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One activation row: elementwise fp32 partials per program, reduced once at the end (a
    reduction per tile would put a barrier between tile loads)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # a ragged last block re-reads row N-1 rather than masking: loads stay unpredicated
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K
    kk = tl.arange(0, BLOCK_K)
    # the weight never depends on earlier kernels: start streaming it before the PDL wait
    w = _row_tile(w_rows, 0, kk, K, EVEN_K)
    pdl_sync(USE_PDL)
    part = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_next = _row_tile(w_rows, k0, kk, K, EVEN_K)
        part += w.to(tl.float32) * _x_tile(x_ptr, k0 - BLOCK_K, kk, K)
        w = w_next
    part += w.to(tl.float32) * _x_tile(x_ptr, (K - 1) // BLOCK_K * BLOCK_K, kk, K)
    acc = tl.sum(part, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.minimum(n, N - 1)).to(tl.float32)
    tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """A few activation rows (padded to the 16 a tensor-core tile needs) against BLOCK_N weight
    rows per program; the K loop is software-pipelined (num_stages) so tiles stay in flight."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K
    kk = tl.arange(0, BLOCK_K)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    pdl_sync(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _row_tile(w_rows, k0, kk, K, EVEN_K)
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + (k0 + kk)[None, :], mask=m_ok[:, None] & (k0 + kk < K)[None, :], other=0.0
        )
        if DOT_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.minimum(n, N - 1)).to(tl.float32)[None, :]
    tl.store(
        y_ptr + m[:, None] * stride_ym + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & (n < N)[None, :],
    )


def default_config(rows: int, n: int, k: int) -> GemvConfig:
    """Tiles from a sweep on an H100 over an 8B model's decode shapes (bench/gpu/gemv_perf.py).

    One row: 8K-element tiles, 4 weight rows per program (within 1% of the best everywhere).
    More rows: 32x256 tiles, 5 stages; mid-width weights (q/k/v, gate/up) do better with 64
    weight rows per program (fewer, longer programs over the same bytes).
    """
    if rows == 1:
        block_k = min(2048, triton.next_power_of_2(k))
        return GemvConfig(block_n=max(1, min(4, 8192 // block_k)), block_k=block_k, num_warps=4)
    if 4096 < n < 65536 and k <= 8192:
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=5)
    return GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=5)


@functools.cache
def _shared_memory_limit(device_index: int) -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return int(props["max_shared_mem"])


def _fit_stages(cfg: GemvConfig, rows: int, elem_bytes: int, device: torch.device) -> int:
    """Pipeline depth that fits the device's shared memory (the sweep ran on 228 KB SMs)."""
    if device.type != "cuda":
        return cfg.num_stages
    limit = _shared_memory_limit(device.index if device.index is not None else torch.cuda.current_device())
    per_stage = (cfg.block_n + max(16, triton.next_power_of_2(rows))) * cfg.block_k * elem_bytes
    return max(1, min(cfg.num_stages, (limit - 8192) // per_stage))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes and layouts these kernels take (anything else goes to F.linear)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        0 < rows <= MAX_ROWS
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T (+ bias) for at most MAX_ROWS rows of x; weight contiguous."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n = x2.shape[0], weight.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    cfg = config or default_config(rows, n, k)
    b = bias if bias is not None else weight  # any pointer: never read without a bias
    common = dict(
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps,
        **pdl_launch(x),
    )
    grid = (triton.cdiv(n, cfg.block_n),)
    if rows == 1:
        _gemv_kernel[grid](x2, weight, b, y, n, k, **common)
    else:
        _skinny_kernel[grid](
            x2,
            weight,
            b,
            y,
            rows,
            n,
            k,
            x2.stride(0),
            y.stride(0),
            BLOCK_M=max(16, triton.next_power_of_2(rows)),
            DOT_PRECISION=dot_precision(x.dtype),
            DOT_FP32=dot_in_fp32(x.dtype),
            num_stages=_fit_stages(cfg, rows, x.element_size(), x.device),
            **common,
        )
    return y.view(*x.shape[:-1], n)
