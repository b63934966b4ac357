"""The fused relay kernels of a captured decode step equal their FutureMap/ModelRunner reference.

CPU: Triton under TRITON_INTERPRET=1, forced on through dispatch.fused_ops; GPU (`gpu` marker):
the same comparison at a served batch size and under CUDA graph capture.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the kernels' import: jit picks the interpreter then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.attention.torch_backend import TorchAttention  # noqa: E402
from engine.future_map import FutureMap, FutureMapError, RelayPayload  # noqa: E402
from engine.kv_cache import KVCacheConfig, KVCacheManager, KVPool  # noqa: E402
from engine.layers.dispatch import fused_ops  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.relay_step import commit_decode, resolve_decode  # noqa: E402
from tests.engine.fused_paths import both_paths  # noqa: E402

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, CTX, PAGE, DEPTH = 8, 64, 4, 4


def _setup(seed: int = 0) -> tuple[FutureMap, ModelRunner]:
    kv = KVCacheManager(KVCacheConfig(ROWS * CTX // PAGE + 2, PAGE, ROWS, CTX), DEV)
    kv.req_to_token.copy_(
        torch.randperm(kv.req_to_token.numel(), generator=torch.Generator().manual_seed(seed))
        .view_as(kv.req_to_token)
        .to(DEV)
    )
    pool = KVPool(1, ROWS * CTX // PAGE + 2, PAGE, 1, 4, torch.float32, DEV)
    runner = ModelRunner(None, kv, pool, TorchAttention(), DEV)  # type: ignore[arg-type]
    runner.max_position = 40  # some lengths below run past it: positions clamp
    fm = FutureMap(ROWS + 1, DEV, need_topk=True, need_hidden=True)
    live = torch.arange(1, ROWS + 1, device=DEV)
    fm.publish(live, torch.randint(1, CTX, (ROWS,), generator=torch.Generator().manual_seed(seed + 1)).to(DEV))
    fm.stash(
        live,
        RelayPayload(
            torch.arange(100, 100 + ROWS, device=DEV),
            torch.zeros(ROWS, 1, device=DEV),
            torch.zeros(ROWS, 1, dtype=torch.int64, device=DEV),
            torch.zeros(ROWS, 8, device=DEV),
        ),
    )
    return fm, runner


@pytest.mark.parametrize("slots", [[3, 1, 7], [5, 0, 0, 2], [8]])
def test_resolve_decode_equals_reference(slots: list[int]) -> None:
    def run():
        fm, runner = _setup()
        s = torch.tensor(slots, device=DEV)
        prefix, ids, ctx = resolve_decode(fm, runner, s, aux_hidden_layers=(0, 2))
        return prefix, ids, ctx

    (p0, i0, c0), (p1, i1, c1) = both_paths(run)
    assert torch.equal(p0, p1) and torch.equal(i0, i1)
    for name in ("positions", "out_cache_loc", "req_slots", "seq_lens", "extend_lens", "qo_indptr"):
        assert torch.equal(getattr(c0, name), getattr(c1, name)), name
    assert c0.seq_lens_cpu == c1.seq_lens_cpu and c0.extend_lens_cpu == c1.extend_lens_cpu
    assert c1.aux_hidden_layers == (0, 2) and int(c1.positions.max()) <= 40


def test_resolve_decode_fails_on_an_unwritten_row() -> None:
    fm, runner = _setup()
    fm.invalidate(torch.tensor([4], device=DEV))
    with fused_ops("on"), pytest.raises(FutureMapError, match="never published"):
        resolve_decode(fm, runner, torch.tensor([1, 4], device=DEV))


@pytest.mark.parametrize("parts", [1, 3])
def test_commit_decode_equals_reference(parts: int) -> None:
    width = 8 if parts == 3 else 24
    gen = torch.Generator().manual_seed(parts)
    sources = [torch.randn(4, width, generator=gen).to(DEV, torch.bfloat16) for _ in range(parts)]  # as served
    slots = torch.tensor([6, 0, 2, 0], device=DEV)
    prefix = torch.tensor([9, 3, 12, 0], device=DEV)
    tokens = torch.tensor([11, 12, 13, 14], device=DEV)

    def run():
        fm, _ = _setup()
        ring_tokens = torch.zeros(ROWS + 1, DEPTH, dtype=torch.int64, device=DEV)
        ring_feats = torch.zeros(ROWS + 1, DEPTH, 24, dtype=torch.bfloat16, device=DEV)
        commit_decode(fm, slots, prefix, tokens, ring_tokens, ring_feats, sources)
        return fm.new_seq_lens_buf.clone(), fm.output_tokens_buf.clone(), ring_tokens[1:], ring_feats[1:]

    ref, got = both_paths(run)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    lens, toks, ring_tokens, _ = got
    assert lens[0] == 0 and toks[0] == 0  # padding rows keep row 0 at zero
    assert lens[6] == 10 and toks[2] == 13 and ring_tokens[5, 9 % DEPTH] == 11


@pytest.mark.gpu
def test_relay_kernels_under_graph_capture() -> None:
    """A captured resolve + commit (64 rows, padding included) leaves what the reference does."""
    slots = torch.tensor([2, 5, 0, 7, 1, 0, 3, 8] + [0] * 56, device=DEV)
    feats = [torch.randn(64, 8, device=DEV) for _ in range(3)]

    def setup():
        fm, runner = _setup()
        ring = (
            torch.zeros(ROWS + 1, DEPTH, dtype=torch.int64, device=DEV),
            torch.zeros(ROWS + 1, DEPTH, 24, dtype=torch.bfloat16, device=DEV),
        )
        return fm, runner, ring

    def body(fm, runner, ring):
        prefix, ids, ctx = resolve_decode(fm, runner, slots)
        commit_decode(fm, slots, prefix, ids + 1, *ring, feats)
        return ctx.out_cache_loc.clone()

    with torch.inference_mode():
        with fused_ops("off"):
            fm0, runner0, ring0 = setup()
            loc0 = body(fm0, runner0, ring0)
        with fused_ops("on"):
            fm1, runner1, ring1 = setup()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loc1 = body(fm1, runner1, ring1)
            graph.replay()
            torch.cuda.synchronize()
    assert torch.equal(loc0, loc1)
    assert torch.equal(fm0.new_seq_lens_buf, fm1.new_seq_lens_buf)
    assert torch.equal(fm0.output_tokens_buf, fm1.output_tokens_buf)
    assert torch.equal(ring0[0][1:], ring1[0][1:]) and torch.equal(ring0[1][1:], ring1[1][1:])
