"""The skinny-GEMM kernels (one-row GEMV, few-row tensor-core kernel) equal F.linear.

CPU: under TRITON_INTERPRET=1 on small ragged shapes. GPU (`gpu` marker): an 8B model's decode
shapes in bf16, and a chain of them captured in a CUDA graph with programmatic dependent launch
replays to the same result as eager.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

if not torch.cuda.is_available():  # must precede the kernels' import: jit picks the interpreter then
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from engine.layers.dispatch import fused_ops, gemv_for  # noqa: E402
from engine.layers.gemv import MAX_ROWS, GemvConfig, gemv  # noqa: E402
from engine.layers.linear import linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, config: GemvConfig | None = None) -> None:
    got = gemv(x, w, b, config)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == ref.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:  # one bf16 rounding of an fp32 sum
        torch.testing.assert_close(got.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(37, 96), (64, 100)])
def test_matches_linear_on_ragged_shapes(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * n + k)
    x = torch.randn(rows, k, dtype=dtype, device=DEV)
    w = torch.randn(n, k, dtype=dtype, device=DEV)
    b = torch.randn(n, dtype=dtype, device=DEV)
    small = GemvConfig(block_n=4 if rows == 1 else 16, block_k=32, num_warps=4, num_stages=2)
    for config in (None, small):  # defaults: one tile covers K; small: several, a ragged last
        _check(x, w, b, config)
        _check(x, w, None, config)


def test_takes_leading_dims_and_strided_rows() -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 32, device=DEV)
    x = torch.randn(2, 2, 48, device=DEV)[..., 8:40]  # rows not contiguous with each other
    got = gemv(x, w)
    assert got.shape == (2, 2, 24)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_dispatch_takes_few_rows_only_and_falls_back_to_linear() -> None:
    w = torch.randn(8, 16, device=DEV)
    with torch.inference_mode(), fused_ops("on"):
        assert gemv_for(torch.randn(1, 16, device=DEV), w) is not None
        assert gemv_for(torch.randn(MAX_ROWS + 1, 16, device=DEV), w) is None
        assert gemv_for(torch.randn(1, 16, device=DEV, dtype=torch.float64), w) is None
        assert gemv_for(torch.randn(1, 8, device=DEV), w.t()) is None  # not contiguous
        x = torch.randn(MAX_ROWS + 1, 16, device=DEV)
        torch.testing.assert_close(linear(x, w), F.linear(x, w))
    with fused_ops("off"):
        assert gemv_for(torch.randn(1, 16, device=DEV), w) is None


SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_gpu_llama8b_shapes_bf16(rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
    _check(x, w, None)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5])
def test_gpu_chain_in_cuda_graph_equals_eager(rows: int) -> None:
    """Each product feeds the next (the PDL wait must order them); replay on new input == eager."""
    torch.manual_seed(0)
    ws = [
        torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 2
    ]
    x = torch.randn(rows, 4096, device=DEV, dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        h = x
        for w in ws:
            h = gemv(h[:, : w.shape[1]], w)
        return h

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, chain(), atol=0, rtol=0)


def test_pdl_is_off_on_cpu_and_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import pdl

    assert pdl.use_pdl(torch.device("cpu")) is False
    assert pdl.pdl_launch(torch.zeros(1)) == {"USE_PDL": False, "launch_pdl": False}
    if torch.cuda.is_available():
        monkeypatch.setenv("PDSERVE_PDL", "0")
        pdl._device_supports_pdl.cache_clear()
        try:
            assert pdl.use_pdl(torch.device("cuda")) is False
        finally:
            monkeypatch.delenv("PDSERVE_PDL")
            pdl._device_supports_pdl.cache_clear()
