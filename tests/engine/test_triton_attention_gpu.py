"""Triton attention at real shapes on a GPU (bf16, GQA 32:8, dim 128, contexts up to 4K)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core import ForwardMode
from tests.engine.test_triton_attention import Setup, compare, random_tree

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2


def real_setup(page_size: int, rows: int, max_ctx: int = 4096 + 64, seed: int = 0) -> Setup:
    return Setup(
        page_size,
        heads=32,
        kv_heads=8,
        head_dim=128,
        pool_dtype=torch.bfloat16,
        rows=rows,
        seed=seed,
        device="cuda",
        max_ctx=max_ctx,
    )


def ragged(n: int, low: int, high: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("bs", [1, 7, 64])
def test_decode_real_shapes(page_size: int, bs: int) -> None:
    setup = real_setup(page_size, bs)
    prefix = ragged(bs, 0, 4095, bs)
    prefix[0] = 4095  # one request at the full 4K context
    compare(setup, ForwardMode.DECODE, prefix, [1] * bs, q_dtype=torch.bfloat16, atol=BF16_TOL)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_prefill_4k_and_chunked(page_size: int) -> None:
    setup = real_setup(page_size, 4)
    compare(setup, ForwardMode.EXTEND, [0], [4096], q_dtype=torch.bfloat16, atol=BF16_TOL)
    compare(setup, ForwardMode.EXTEND, [0, 1000, 3000, 17], [513, 700, 1000, 1], q_dtype=torch.bfloat16, atol=BF16_TOL)


@pytest.mark.parametrize("ntok", [1, 4, 8])
@pytest.mark.parametrize("bs", [1, 64])
def test_target_verify_chain_real(ntok: int, bs: int) -> None:
    setup = real_setup(16, bs)
    compare(
        setup, ForwardMode.TARGET_VERIFY, ragged(bs, 0, 4000, ntok), [ntok] * bs, q_dtype=torch.bfloat16, atol=BF16_TOL
    )


def test_target_verify_tree_and_draft_steps_real() -> None:
    bs = 16
    setup = real_setup(16, bs)
    seq = ragged(bs, 1, 4000, 3)
    tree = random_tree(bs, 8, 8, 0)
    compare(setup, ForwardMode.TARGET_VERIFY, seq, [8] * bs, tree_mask=tree, q_dtype=torch.bfloat16, atol=BF16_TOL)
    k = 4
    for step in (1, 2, 3):
        compare(
            setup,
            ForwardMode.DECODE,
            [s + (step - 1) * k for s in seq],
            [k] * bs,
            tree_mask=random_tree(bs, k, step * k, step),
            q_dtype=torch.bfloat16,
            atol=BF16_TOL,
        )


@pytest.mark.parametrize("ntok", [1, 4])
def test_cuda_graph_replay_follows_device_lengths(ntok: int) -> None:
    """Captured once, replayed with other lengths and slots: results follow the device values."""
    from engine.attention import create_attention_backend
    from engine.attention.torch_backend import TorchAttention

    bs = 8
    setup = real_setup(16, bs)
    runner = setup.runner(setup.pool)
    backend = create_attention_backend("triton")

    def context(prefix: list[int]):
        return runner.make_context(
            ForwardMode.TARGET_VERIFY if ntok > 1 else ForwardMode.DECODE, list(range(1, bs + 1)), prefix, [ntok] * bs
        )

    static = context(ragged(bs, 0, 100, 0))
    q, k, v = setup.qkv(bs * ntok, torch.bfloat16)
    scale = 128**-0.5
    backend.prepare(static)
    backend.forward(q, k, v, 0, scale, static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.prepare(static)
        out = backend.forward(q, k, v, 0, scale, static)
    live = context(ragged(bs, 1000, 4000, 1))
    for name in ("positions", "out_cache_loc", "seq_lens", "extend_lens", "qo_indptr"):
        getattr(static, name).copy_(getattr(live, name))
    graph.replay()
    ref = TorchAttention()
    ref.prepare(live)
    want = ref.forward(q, k, v, 0, scale, live)
    torch.testing.assert_close(out.float(), want.float(), atol=BF16_TOL, rtol=BF16_TOL)
