"""Prompt graphs (engine/prompt_graphs.py): ragged prompt batches padded to token and row buckets.

CPU: the Triton kernels on a bucket's static context (grids sized by the bucket, padded rows and
tokens) equal the torch reference on the live batch; the runner's padded-eager prompt path equals
eager for the target and the EAGLE draft, over cached prefixes; engines with prompt graphs give
plain greedy output. GPU: captured prompt graphs equal eager, and engines with them on equal off.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine.attention.torch_backend import TorchAttention
from engine.attention.triton_backend import TritonAttention
from engine.core import ForwardMode, SamplingParams
from engine.engine import Engine, EngineConfig
from engine.prompt_graphs import PromptBuckets, load_prompt_context, static_prompt_context
from tests.engine.graph_rig import Rig
from tests.engine.test_cuda_graph import check_graph, eager_and_graph
from tests.engine.test_triton_attention import Setup

X, E = ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_buckets_fit_the_smallest_shape() -> None:
    b = PromptBuckets.up_to(300, 6)
    assert b is not None and b.tokens == (32, 64, 128, 160, 192, 256) and b.rows == (1, 2, 4)
    assert b.fit(1, 1) == (32, 1) and b.fit(33, 3) == (64, 4) and b.fit(256, 4) == (256, 4)
    assert b.fit(170, 1) == (192, 1)  # a follow-up turn's suffix: finer steps below 512
    assert b.fit(257, 1) is None and b.fit(10, 5) is None and b.fit(0, 1) is None
    assert b.shapes()[0] == (256, 4) and len(b.shapes()) == 18
    assert PromptBuckets.up_to(16, 8) is None and PromptBuckets.up_to(512, 0) is None
    # past 512 (a prefill node's long prompt batches) every 256 tokens, up to a 2,048-token budget
    wide = PromptBuckets.up_to(2048, 8)
    assert wide is not None and wide.tokens[8:] == (512, 768, 1024, 1280, 1536, 1792, 2048)
    assert wide.fit(1500, 2) == (1536, 2) and wide.fit(2048, 8) == (2048, 8) and wide.fit(2049, 1) is None
    assert PromptBuckets.up_to(512, 8).tokens[-1] == 512  # the default stops where it did


# ---- the kernels on a bucket's static context ----
@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="Triton needs CUDA or the interpreter")
@pytest.mark.parametrize("split_max_rows", [0, 10_000])  # the extend kernel, then split-K
def test_triton_on_a_bucket_equals_torch_on_the_batch(split_max_rows: int) -> None:
    setup = Setup(4, heads=4, kv_heads=2)
    prefix, extend = [9, 0, 21], [5, 7, 3]  # cached prefixes, one cold request
    ctx = setup.runner(setup.pool).make_context(X, [2, 1, 3], prefix, extend)
    n, tokens, rows = sum(extend), 32, 4
    q, k, v = setup.qkv(n, torch.float32)
    ref = TorchAttention()
    ref.prepare(ctx)
    want = ref.forward(q, k, v, 1, 0.25, ctx)

    static = static_prompt_context(X, tokens, rows, (), setup.pool, setup.kv.req_to_token, None, q.device)
    load_prompt_context(static, ctx, padded_eager=False)
    # row 3 owns the padded tokens, row 4 none
    assert static.qo_indptr.tolist() == [0, 5, 12, 15, 32, 32] and static.extend_lens.tolist() == [5, 7, 3, 17, 0]

    def pad(t: torch.Tensor) -> torch.Tensor:  # padded tokens: anything finite
        return torch.cat([t, torch.randn(tokens - n, *t.shape[1:], generator=setup.gen, device=t.device)])

    before = setup.pool.buffer[:, :, 1:].clone()
    backend = TritonAttention(split_max_rows=split_max_rows)
    backend.prepare(static)
    got = backend.forward(pad(q), pad(k), pad(v), 1, 0.25, static)
    torch.testing.assert_close(got[:n], want, atol=2e-5, rtol=2e-5)
    # the live tokens' K/V were stored where the torch reference stored them, nothing else moved
    torch.testing.assert_close(setup.pool.buffer[:, :, 1:], before)


# ---- the runner's padded-eager prompt path ----
def prompt(runner, rig: Rig, reqs, prefix: list[int], extend: list[int], *, aux=(), features=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ctx = runner.make_context(runner_mode(runner, rig), [r.slot for r in reqs], prefix, extend, aux_hidden_layers=aux)
    ids = torch.randint(1, rig.vocab, (sum(extend),), generator=gen).to(rig.dev)
    feats = torch.randn(sum(extend), rig.hidden, generator=gen).to(rig.dev, rig.target.pool.buffer.dtype)
    kw = {"features": feats} if features else {}
    return runner.forward(ids, ctx, **kw)


def runner_mode(runner, rig: Rig) -> ForwardMode:
    return X if runner is rig.target else E


@pytest.mark.parametrize("which", ["target", "draft"])
def test_padded_prompt_path_equals_eager(rig, which: str) -> None:
    runner = getattr(rig, which)
    assert runner.enable_cuda_graphs(8, capture=False, prompt_tokens=64)
    kw = {"aux": (0, 1)} if which == "target" else {"features": True}
    reqs = rig.requests(3, 40)
    shapes = [([0], [7]), ([0, 5, 11], [9, 30, 2]), ([3, 0], [40, 20])]  # 7 -> 32x1, 41 -> 64x4, 60 -> 64x2
    for i, (prefix, extend) in enumerate(shapes):
        live = reqs[: len(prefix)]
        ref, out = eager_and_graph(runner, lambda: prompt(runner, rig, live, prefix, extend, seed=i, **kw))
        torch.testing.assert_close(out, ref)
    s = runner.graph_stats
    assert (s.captures, s.hits, s.eager) == (3, 0, 0), s
    # one draft request's window is uniform: a fixed-width graph takes it while capture is open
    single = (32, 1) if which == "target" else (7, 1)
    assert {(t, b) for m, t, b in runner.graph_shapes()} == {single, (64, 4), (64, 2)}
    big = rig.requests(1, 80)
    prompt(runner, rig, big, [0], [80], **kw)  # past the largest bucket: eager
    assert runner.graph_stats.eager_reasons["prompt batch larger than its buckets"] == 1


def test_a_long_prompt_batch_on_a_wide_bucket_equals_eager(rig) -> None:
    """Buckets past 512 tokens: 730 cold and cached-prefix tokens pad to 768, a row to spare."""
    runner = rig.target
    assert runner.enable_cuda_graphs(8, capture=False, prompt_tokens=1024)
    reqs = rig.requests(3, 600)
    prefix, extend = [0, 24, 3], [560, 150, 20]
    ref, out = eager_and_graph(runner, lambda: prompt(runner, rig, reqs, prefix, extend, aux=(0, 1)))
    torch.testing.assert_close(out, ref)
    assert {(t, b) for m, t, b in runner.graph_shapes()} == {(768, 4)}


def test_precaptured_prompt_graphs_are_hit(rig) -> None:
    runner = rig.draft
    runner.enable_cuda_graphs(2, capture=False, prompt_tokens=64)
    assert runner.capture_prompts(E, features=torch.zeros(0, rig.hidden)) == 4  # (32, 64) x (1, 2)
    runner.freeze_graphs()
    reqs = rig.requests(2, 40)
    prompt(runner, rig, reqs, [2, 0], [30, 20], features=True)
    prompt(runner, rig, reqs[:1], [0], [4], features=True)  # 1 x 4 tokens: a prompt graph too
    s = runner.graph_stats
    assert (s.captures, s.hits, s.eager) == (4, 2, 0), s


def _engine(model, graphs: bool, prompt_tokens: int, algorithm=None, **extra) -> Engine:
    """A tiny engine with prompt graphs up to `prompt_tokens` (padded-eager: the CPU's graph path), or without."""
    cfg = EngineConfig(
        str(model),
        page_size=4,
        cuda_graph_max_bs=4 if graphs else 0,
        cuda_graph_padded_eager=graphs,
        cuda_graph_prompt_tokens=prompt_tokens,
        **extra,
    )
    return Engine(cfg, algorithm=algorithm)


def _two_turns(eng: Engine, history, follow, params: SamplingParams) -> list[list[int]]:
    """Greedy outputs of cold prompts, then of follow-ups over their cached prefixes."""
    return [o.output_ids for o in eng.generate(history, params) + eng.generate(follow, params)]


@pytest.mark.parametrize("spec", [None, "EAGLE"])
def test_engine_with_prompt_graphs_equals_plain(tiny_llama_dir, head_dir, spec) -> None:
    """Cold prompts, then follow-ups over cached prefixes, in batches the buckets hold."""
    from spec.config import SpecConfig
    from spec.registry import bind

    history = [list(range(3, 40)), [8, 1, 9], list(range(100, 150))]
    follow = [h + [11, 12, 13] for h in history]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)

    def run(graphs: bool) -> list[list[int]]:
        algorithm = bind(SpecConfig("EAGLE", str(head_dir), 3, 1, None)) if spec else None
        eng = _engine(tiny_llama_dir, graphs, 128, algorithm)
        outs = _two_turns(eng, history, follow, greedy)
        if graphs:
            runners = [eng.executor.target, eng.executor.draft] if spec else [eng.parts.runner]
            for r in runners:
                assert any(k.ragged for k in r.graphs._graphs), r.graph_shapes()
                assert "prompt batch larger than its buckets" not in r.graph_stats.eager_reasons
        assert eng.kv.all_free
        return outs

    assert run(True) == run(False)


def test_engine_with_wide_prompt_graphs_equals_plain(tmp_path) -> None:
    """Prompts of 600-1,300 tokens and follow-ups of 150 more over them, on graphs up to 2,048
    tokens: every batch on a bucket (none eager), plain greedy output, every page back."""
    import random

    from fixtures.tiny_model import write_tiny_model

    model = write_tiny_model(
        tmp_path, "LlamaForCausalLM", seed=0, num_heads=4, num_kv_heads=2, max_position_embeddings=4096
    )
    rng = random.Random(0)
    history = [[rng.randrange(3, 200) for _ in range(n)] for n in (900, 1300, 600)]
    follow = [h + [5, 6, 7] * 50 for h in history]
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)

    def run(graphs: bool) -> list[list[int]]:
        eng = _engine(model, graphs, 2048, max_total_tokens=16384)
        outs = _two_turns(eng, history, follow, greedy)
        if graphs:
            runner = eng.parts.runner
            assert max(t for _, t, _ in runner.graph_shapes()) == 2048
            assert not runner.graph_stats.eager_reasons, runner.graph_stats.eager_reasons
        assert eng.kv.all_free
        return outs

    assert run(True) == run(False)


# ---- GPU: captured prompt graphs ----
@pytest.fixture(scope="module")
def gpu_rig(tiny_llama_dir, head_dir) -> Rig:
    rig = Rig(tiny_llama_dir, head_dir, device="cuda", dtype="bfloat16", backend="triton")
    for runner in (rig.target, rig.draft):
        assert runner.enable_cuda_graphs(8, prompt_tokens=1024)  # past 512: the wide buckets too
    return rig


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [([0], [7]), ([0, 5, 11], [9, 100, 2]), ([3, 0, 17, 1, 0], [200, 50, 90, 30, 40]), ([0, 24, 3], [560, 150, 20])],
)
def test_gpu_prompt_graphs_equal_eager(gpu_rig, shape) -> None:
    prefix, extend = shape
    reqs = gpu_rig.requests(len(prefix), max(extend) + 20)
    try:
        check_graph(gpu_rig.target, lambda: prompt(gpu_rig.target, gpu_rig, reqs, prefix, extend, aux=(0, 1)))
        check_graph(gpu_rig.draft, lambda: prompt(gpu_rig.draft, gpu_rig, reqs, prefix, extend, features=True))
    finally:
        gpu_rig.release(reqs)
