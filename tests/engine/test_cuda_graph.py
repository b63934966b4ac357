"""CUDA graphs in the model runner: the padded static-buffer path equals plain eager.

CPU: the runner's "padded eager" mode (enable_cuda_graphs(..., capture=False)) runs exactly the
static-buffer + padding code with the torch backend. GPU: captured graphs with the Triton backend
against the torch backend run eagerly, and whole engines with graphs on and off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import create_attention_backend
from engine.core import ForwardMode, Req, SamplingParams
from engine.cuda_graph import default_batch_sizes
from engine.engine import Engine, EngineConfig
from engine.model_runner import ModelRunner
from tests.engine.graph_rig import Rig

D, V, E = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND


def tree_mask(bs: int, q: int, width: int, device) -> torch.Tensor:
    """Every query sees itself and the first window key (the root), like a star-shaped tree."""
    m = torch.zeros(bs, q, width, dtype=torch.bool, device=device)
    m[:, torch.arange(q), torch.arange(width - q, width)] = True
    m[:, :, 0] = True
    return m


def step(
    runner: ModelRunner,
    rig: Rig,
    mode: ForwardMode,
    reqs: list[Req],
    tpr: int,
    *,
    offset: int = 0,
    tree_width: int | None = None,
    features: bool = False,
    aux: tuple[int, ...] = (),
    seed: int = 0,
):
    """One forward of `tpr` tokens per request after each request's prompt (+ offset)."""
    bs = len(reqs)
    gen = torch.Generator().manual_seed(seed)
    prefix = [len(r.prompt_ids) + offset for r in reqs]
    mask = None if tree_width is None else tree_mask(bs, tpr, tree_width, rig.dev)
    ctx = runner.make_context(mode, [r.slot for r in reqs], prefix, [tpr] * bs, tree_mask=mask, aux_hidden_layers=aux)
    ids = torch.randint(1, rig.vocab, (bs * tpr,), generator=gen).to(rig.dev)
    kw = {}
    if features:
        kw["features"] = torch.randn(bs * tpr, rig.hidden, generator=gen).to(rig.dev, rig.target.pool.buffer.dtype)
    return runner.forward(ids, ctx, **kw)


def eager_and_graph(runner: ModelRunner, run):
    """(plain eager output, graph-path output); also checks the graph path leaves real pages as
    eager wrote them (padded rows may only touch page 0)."""
    graphs, runner.graphs = runner.graphs, None
    ref = run()
    runner.graphs = graphs
    before = runner.pool.buffer[:, :, 1:].clone()
    out = run()
    torch.testing.assert_close(runner.pool.buffer[:, :, 1:], before, atol=1e-5, rtol=1e-5)
    return ref, out


# ---- CPU: padded eager == eager ----
def test_default_batch_sizes():
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(100)[-3:] == [80, 96, 100]


def test_graphs_stay_off_on_cpu(rig):
    assert rig.target.enable_cuda_graphs(8) is False
    assert rig.target.graphs is None and rig.target.capture(D, 1) == 0


def test_decode_padded_equals_eager(rig):
    runner = rig.target
    assert runner.enable_cuda_graphs(8, [1, 4, 8], capture=False)
    for bs in (1, 3, 5, 8):  # 3 -> 4 and 5 -> 8 need padding
        reqs = rig.requests(bs, 1)
        ref, out = eager_and_graph(runner, lambda: step(runner, rig, D, reqs, 1, seed=bs))
        torch.testing.assert_close(out, ref)
        assert out[0].shape[0] == bs
        rig.release(reqs)
    s = runner.graph_stats
    assert (s.captures, s.hits, s.eager) == (3, 1, 0)


@pytest.mark.parametrize("tree", [False, True])
def test_target_verify_padded_equals_eager(rig, tree):
    runner, ntok = rig.target, 4
    runner.enable_cuda_graphs(8, [4, 8], capture=False)
    reqs = rig.requests(3, ntok)
    ref, out = eager_and_graph(
        runner, lambda: step(runner, rig, V, reqs, ntok, aux=(0, 1), tree_width=ntok if tree else None)
    )
    torch.testing.assert_close(out, ref)
    assert len(out[1]) == 2 and out[1][0].shape[0] == 3 * ntok
    assert runner.graph_stats.captures == 1 and runner.graph_stats.eager == 0


def test_draft_steps_and_extend_padded_equal_eager(rig):
    runner, k, ntok = rig.draft, 2, 4
    runner.enable_cuda_graphs(8, [4, 8], capture=False)
    reqs = rig.requests(3, 3 * k + ntok)
    for s in (1, 2):  # draft steps: k tokens per request, the tree window grows by k a step
        ref, out = eager_and_graph(
            runner, lambda: step(runner, rig, D, reqs, k, offset=(s - 1) * k, tree_width=s * k, features=True, seed=s)
        )
        torch.testing.assert_close(out, ref)
    ref, out = eager_and_graph(runner, lambda: step(runner, rig, E, reqs, ntok, features=True))
    torch.testing.assert_close(out, ref)
    assert out.shape == (3 * ntok, rig.hidden)
    s = runner.graph_stats
    assert (s.captures, s.eager) == (3, 0)


def test_ragged_prefill_and_big_batches_run_eagerly(rig):
    runner = rig.draft
    runner.enable_cuda_graphs(2, capture=False)
    reqs = rig.requests(3, 4)
    slots = [r.slot for r in reqs]
    feats = torch.randn(9, rig.hidden)
    ragged = runner.make_context(E, slots[:2], [5, 8], [4, 5])
    prefill = runner.make_context(ForwardMode.EXTEND, slots[:1], [0], [4])
    big = runner.make_context(D, slots, [5, 8, 11], [1, 1, 1])
    runner.forward(torch.ones(9, dtype=torch.int64), ragged, features=feats)
    runner.forward(torch.ones(4, dtype=torch.int64), prefill, features=feats[:4])
    runner.forward(torch.ones(3, dtype=torch.int64), big, features=feats[:3])
    s = runner.graph_stats
    assert (s.captures, s.hits, s.eager) == (0, 0, 3)
    assert set(s.eager_reasons) == {"ragged extend lengths", "mode EXTEND", "batch too large"}


def test_precapture_then_hit(rig):
    runner = rig.draft
    runner.enable_cuda_graphs(4, capture=False)
    example = torch.zeros(0, rig.hidden)
    assert runner.capture(D, 2, [3], tree_width=4, features=example) == 1  # padded to 4
    assert runner.capture(D, 2, [4], tree_width=4, features=example) == 0  # already there
    reqs = rig.requests(3, 8)
    ref, out = eager_and_graph(runner, lambda: step(runner, rig, D, reqs, 2, offset=2, tree_width=4, features=True))
    torch.testing.assert_close(out, ref)
    assert (runner.graph_stats.captures, runner.graph_stats.hits) == (1, 1)


def test_eagle_engine_padded_eager_equals_plain(tiny_llama_dir, head_dir):
    from spec.config import SpecConfig
    from spec.registry import bind

    prompts = [[5, 17, 42, 7, 99], [8, 1], list(range(100, 113))]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

    def run(padded: bool) -> list[list[int]]:
        eng = Engine(
            EngineConfig(str(tiny_llama_dir), page_size=4), algorithm=bind(SpecConfig("EAGLE", str(head_dir), 3, 2, 5))
        )
        if padded:
            for r in (eng.executor.target, eng.executor.draft):
                r.enable_cuda_graphs(4, [2, 4], capture=False)
        outs = [o.output_ids for o in eng.generate(prompts, greedy)]
        if padded:
            assert eng.executor.target.graph_stats.hits > 0 and eng.executor.draft.graph_stats.hits > 0
        assert eng.kv.all_free
        return outs

    assert run(True) == run(False)


# ---- GPU: captured graphs (Triton backend) == eager (torch backend) ----
BF16 = {"atol": 5e-2, "rtol": 5e-2}


@pytest.fixture(scope="module")
def gpu_rig(tiny_llama_dir, head_dir) -> Rig:
    rig = Rig(tiny_llama_dir, head_dir, device="cuda", dtype="bfloat16", backend="triton")
    for runner in (rig.target, rig.draft):
        assert runner.enable_cuda_graphs(64)
    return rig


def graph_vs_eager(runner: ModelRunner, run):
    """(torch backend eager, Triton eager, Triton through a graph), all on the same inputs."""
    graph_backend, graphs = runner.attn_backend, runner.graphs
    runner.graphs = None
    try:
        runner.attn_backend = create_attention_backend("torch")
        ref = run()
        runner.attn_backend = graph_backend
        same_kernels = run()
    finally:
        runner.attn_backend, runner.graphs = graph_backend, graphs
    return ref, same_kernels, run()


def check_graph(runner: ModelRunner, run, tight: dict | None = None) -> None:
    hits, captures = runner.graph_stats.hits, runner.graph_stats.captures
    ref, same, out = graph_vs_eager(runner, run)
    torch.testing.assert_close(out, ref, **BF16)
    torch.testing.assert_close(out, same, **(tight or BF16))
    stats = runner.graph_stats
    assert stats.hits + stats.captures == hits + captures + 1, "the forward did not use a graph"


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 3, 7, 16, 33, 64])
def test_gpu_decode_graph_equals_eager(gpu_rig, bs):
    reqs = gpu_rig.requests(bs, 1)
    try:
        check_graph(gpu_rig.target, lambda: step(gpu_rig.target, gpu_rig, D, reqs, 1, seed=bs))
        check_graph(gpu_rig.target, lambda: step(gpu_rig.target, gpu_rig, D, reqs, 1, seed=bs + 1))  # a hit
    finally:
        gpu_rig.release(reqs)


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("bs", [2, 5])
def test_gpu_target_verify_graph_equals_eager(gpu_rig, tree, bs):
    reqs = gpu_rig.requests(bs, 4)
    try:
        check_graph(
            gpu_rig.target,
            lambda: step(gpu_rig.target, gpu_rig, V, reqs, 4, aux=(0, 1), tree_width=4 if tree else None),
        )
    finally:
        gpu_rig.release(reqs)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 6])
def test_gpu_draft_steps_and_extend_graph_equal_eager(gpu_rig, bs):
    runner, k, ntok = gpu_rig.draft, 2, 4
    reqs = gpu_rig.requests(bs, 3 * k + ntok)
    try:
        for s in (1, 2, 3):
            check_graph(
                runner,
                lambda: step(runner, gpu_rig, D, reqs, k, offset=(s - 1) * k, seed=s, tree_width=s * k, features=True),
            )
        check_graph(runner, lambda: step(runner, gpu_rig, E, reqs, ntok, features=True))
    finally:
        gpu_rig.release(reqs)


@pytest.mark.gpu
def test_gpu_precapture_serves_the_first_decode(gpu_rig):
    runner = gpu_rig.target
    runner.capture(D, 1, [24])  # a size no other test pads to
    captures = runner.graph_stats.captures
    reqs = gpu_rig.requests(20, 1)
    try:
        step(runner, gpu_rig, D, reqs, 1)
    finally:
        gpu_rig.release(reqs)
    assert runner.graph_stats.captures == captures


GPU_PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [8, 1], list(range(100, 121)), [300] * 5, [7] * 3]
GPU_GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def _gpu_engine(model_dir: Path, graphs: bool, spec_cfg=None) -> Engine:
    """fp32 so that padding (other matmul shapes) cannot flip a near-tie of a random model."""
    from spec.registry import bind

    eng = Engine(
        EngineConfig(str(model_dir), device="cuda", dtype="float32", page_size=4, attention_backend="triton"),
        algorithm=bind(spec_cfg) if spec_cfg else None,
    )
    runners = [eng.executor.target, eng.executor.draft] if spec_cfg else [eng.parts.runner]
    for r in runners:
        if graphs:
            assert r.enable_cuda_graphs(8)
        else:
            r.disable_cuda_graphs()  # whatever EngineConfig wired
    return eng


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, ("EAGLE", 3, 1, None), ("EAGLE", 3, 2, 5)])
def test_gpu_engine_greedy_graphs_on_equals_off(tiny_llama_dir, head_dir, spec):
    from spec.config import SpecConfig

    cfg = SpecConfig(spec[0], str(head_dir), *spec[1:]) if spec else None
    outs = {}
    for graphs in (False, True):
        eng = _gpu_engine(tiny_llama_dir, graphs, cfg)
        outs[graphs] = [o.output_ids for o in eng.generate(GPU_PROMPTS, GPU_GREEDY)]
        assert eng.kv.all_free
        if graphs:
            main = eng.executor.target if spec else eng.parts.runner
            assert main.graph_stats.hits > 0, main.graph_stats
    assert outs[True] == outs[False]


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_whole_step_graphs_equal_eager(tiny_llama_dir, overlap):
    """Greedy decode steps run as whole-step bodies on padded buffers (the captured graph's twin);
    a batch with a sampled request falls back to the per-op path; results equal graphs off."""
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
    prompts = [[5, 17, 42, 7, 99], [8, 1], list(range(100, 113))]

    def run(graphs: bool) -> tuple[list[list[int]], list[list[int]], int]:
        eng = Engine(
            EngineConfig(
                str(tiny_llama_dir),
                page_size=4,
                overlap=overlap,
                cuda_graph_max_bs=4 if graphs else 0,
                cuda_graph_padded_eager=graphs,
            )
        )
        only_greedy = [o.output_ids for o in eng.generate(prompts, greedy)]
        hits = eng.executor.step_graphs.hits if graphs else 0
        mixed = [o.output_ids for o in eng.generate(prompts, [greedy, sampled, greedy])]
        assert eng.kv.all_free and eng.scheduler.future_map.rows_free()
        return only_greedy, mixed, hits

    ref_greedy, ref_mixed, _ = run(False)
    out_greedy, out_mixed, hits = run(True)
    assert out_greedy == ref_greedy and out_mixed == ref_mixed
    assert hits > 0
