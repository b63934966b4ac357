"""Mixed batches: a plain decode step and a prompt chunk in one forward (a decode node's own prompts).

CPU: buckets; the Triton backend on a mixed context (decode rows through the split-K kernel, the
chunk through the extend kernel, live and on a bucket's static layout) equals the torch reference;
the runner's padded-eager mixed path equals eager; engines under a TPOT guard mix (plain decoding),
give the output they give unmixed, with overlap on and off, with and without mixed graphs, and
free every page; the node rates learn a chunk's marginal rate. GPU: captured mixed graphs equal eager.
"""

from __future__ import annotations

import dataclasses

import os
import random
import time

import pytest
import torch

from engine.attention.torch_backend import TorchAttention
from engine.attention.triton_backend import TritonAttention
from engine.core import ForwardMode, SamplingParams
from engine.mixed_graphs import MixedBuckets, live_rows, load_mixed_context, place_tokens, static_mixed_context
import engine.scheduler.rates as rates_module
from engine.scheduler.rates import MIXED_FRESH_S, MIXED_MAX_SPEEDUP, MIXED_MIN_TOKENS, NodeRates
from tests.engine.graph_rig import Rig
from tests.engine.test_cuda_graph import check_graph, eager_and_graph
from tests.engine.test_tpot_guard import EARLY, LATE, FixedRates, _req, make_engine, models, staggered  # noqa: F401 - fixture
from tests.engine.test_triton_attention import Setup

X, D, M = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_buckets_fit_the_smallest_shape() -> None:
    b = MixedBuckets.up_to(300, 40)
    assert b is not None and b.tokens == (64, 128, 256) and b.decode == (1, 2, 4, 8, 16, 24, 32, 40)
    assert b.fit(1, 1, 1) == (1, 64) and b.fit(17, 65, 1) == (24, 128) and b.fit(40, 256, 1) == (40, 256)
    assert b.fit(41, 10, 1) is None and b.fit(3, 257, 1) is None and b.fit(3, 10, 2) is None
    assert b.shapes()[0] == (40, 256) and len(b.shapes()) == 24
    assert MixedBuckets.up_to(32, 8) is None


# ---- the kernels ----
def _mixed_ctx(setup: Setup):
    prefix, extend = [9, 21, 3], [1, 1, 7]  # two decode rows, then a chunk over a cached prefix
    ctx = setup.runner(setup.pool).make_context(X, [2, 1, 3], prefix, extend, decode_rows=2)
    q, k, v = setup.qkv(sum(extend), torch.float32)
    ref = TorchAttention()
    ref.prepare(ctx)
    return ctx, (q, k, v), ref.forward(q, k, v, 1, 0.25, ctx)


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="Triton needs CUDA or the interpreter")
def test_triton_on_a_mixed_batch_equals_torch() -> None:
    setup = Setup(4, heads=4, kv_heads=2)
    ctx, (q, k, v), want = _mixed_ctx(setup)
    backend = TritonAttention()
    backend.prepare(ctx)
    torch.testing.assert_close(backend.forward(q, k, v, 1, 0.25, ctx), want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="Triton needs CUDA or the interpreter")
def test_triton_on_a_mixed_bucket_equals_torch_on_the_batch() -> None:
    setup = Setup(4, heads=4, kv_heads=2)
    ctx, (q, k, v), want = _mixed_ctx(setup)
    n, decode, tokens = ctx.num_tokens, 4, 16
    static = static_mixed_context(decode, tokens, setup.pool, setup.kv.req_to_token, None, q.device)
    load_mixed_context(static, ctx, padded_eager=False)
    # decode rows 2-3 are padding (length 1), row 4 the chunk, row 5 owns the 9 padded tokens
    assert static.qo_indptr.tolist() == [0, 1, 2, 3, 4, 11, 20]
    assert static.extend_lens.tolist() == [1, 1, 1, 1, 7, 9] and static.seq_lens.tolist() == [10, 22, 1, 1, 10, 9]

    def placed(t: torch.Tensor) -> torch.Tensor:
        out = torch.randn(decode + tokens, *t.shape[1:], generator=setup.gen, device=t.device)
        keep = live_rows(2, decode, n, t.device)
        pad = torch.ones(decode + tokens, dtype=torch.bool)
        pad[keep] = False
        place_tokens(out, t, 2, decode)
        out[pad] = torch.randn(int(pad.sum()), *t.shape[1:], generator=setup.gen)  # padding: anything finite
        return out

    before = setup.pool.buffer[:, :, 1:].clone()
    backend = TritonAttention()
    backend.prepare(static)
    got = backend.forward(placed(q), placed(k), placed(v), 1, 0.25, static)
    torch.testing.assert_close(got[live_rows(2, decode, n, q.device)], want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(setup.pool.buffer[:, :, 1:], before)  # live K/V as the reference stored it


# ---- the runner's padded-eager mixed path ----
def mixed(runner, rig: Rig, reqs, prefix: list[int], extend: list[int], decode_rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ctx = runner.make_context(X, [r.slot for r in reqs], prefix, extend, decode_rows=decode_rows)
    ids = torch.randint(1, rig.vocab, (sum(extend),), generator=gen).to(rig.dev)
    return runner.forward(ids, ctx)


def test_padded_mixed_path_equals_eager(rig) -> None:
    runner = rig.target
    assert runner.enable_cuda_graphs(8, capture=False, prompt_tokens=64, mixed_chunk_tokens=128)
    assert runner.capture_mixed() == 4 * 2  # decode (1, 2, 4, 8) x chunk (64, 128)
    runner.freeze_graphs()
    reqs = rig.requests(4, 100)
    shapes = [([5], [1], 0), ([5, 9, 0], [1, 1, 30], 2), ([7, 3, 11, 2], [1, 1, 1, 100], 3)]
    for i, (prefix, extend, d) in enumerate(shapes):
        live = reqs[: len(prefix)]
        ref, out = eager_and_graph(runner, lambda: mixed(runner, rig, live, prefix, extend, d, seed=i))
        torch.testing.assert_close(out, ref)
    s = runner.graph_stats
    assert s.hits == 2 and s.eager == 1, s  # the first has no decode rows: a prompt batch (eager once frozen)


# ---- engines under a TPOT guard ----
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_guarded_prompts_ride_in_decode_steps_and_change_no_token(models, overlap, graphs):  # noqa: F811
    kw = {"overlap": overlap, "tpot_guard_ms": 25.0}
    if graphs:
        kw |= {"cuda_graph_max_bs": 4, "cuda_graph_padded_eager": True, "cuda_graph_prompt_tokens": 64}
    want, _, _ = staggered(make_engine(models, "plain", overlap=overlap))
    unmixed, plain_modes, _ = staggered(make_engine(models, "plain", mixed_chunk=False, **kw))
    eng = make_engine(models, "plain", **kw)  # mixing is the default
    got, modes, _ = staggered(eng)
    assert got == unmixed == want
    assert M in modes and M not in plain_modes
    assert eng.scheduler.stats["mixed_steps"] == modes.count(M)
    # launched and charged as mixed, apart from prompt batches and decode steps (node metrics)
    assert eng.scheduler.launch_time.by_kind["mixed"].snapshot()[0][-1][1] == modes.count(M)
    assert eng.rates.step_time.by_kind["mixed"].snapshot()[0][-1][1] == modes.count(M)
    if graphs:
        assert any(k.decode_rows for k in eng.parts.runner.graphs._graphs)
        assert eng.parts.runner.graph_stats.eager_reasons["not a mixed batch"] == 0


def test_sampled_mixed_batches_draw_what_unmixed_ones_draw(models):  # noqa: F811
    """Seeded sampling (the general sampler path, not the greedy argmax) keys its noise by each
    token's position, so where a token is drawn (a mixed step or a decode step) changes nothing."""
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    prompts = EARLY + LATE

    def run(mixed: bool) -> list[list[int]]:
        eng = make_engine(models, "plain", tpot_guard_ms=1000.0, mixed_chunk=mixed)
        outs = [o.output_ids for o in eng.generate(prompts, params)]
        assert (eng.scheduler.stats["mixed_steps"] > 0) == mixed and eng.kv.all_free
        return outs

    assert run(True) == run(False)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_random_aborts_and_retractions_under_mixing_free_every_page(models, overlap):  # noqa: F811
    """A pool too small for everyone (decode steps retract) and aborts at random moments, while
    prompts ride in decode steps: survivors' outputs are the unguarded engine's, every page returns."""
    prompts = [[7 + i, 100 + i, 200 + i] * (3 + i) for i in range(6)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.output_ids for o in make_engine(models, "plain", max_total_tokens=64).generate(prompts, params)]
    eng = make_engine(models, "plain", max_total_tokens=64, tpot_guard_ms=1000.0, mixed_chunk=True, overlap=overlap)
    rng = random.Random(1)
    rids = [eng.add_request(prompts[0], params), eng.add_request(prompts[1], params)]
    got: dict[str, list[int]] = {r: [] for r in rids}
    doomed: set[str] = set()
    steps = 0
    while eng.scheduler.has_work or steps < 3:
        if steps == 2:  # the rest arrive while the first two decode: their prompts mix
            rids += [eng.add_request(p, params) for p in prompts[2:]]
            got.update({r: [] for r in rids[2:]})
        if steps in (5, 9):
            rid = rng.choice([r for r in rids if r not in doomed])
            doomed.add(rid)
            eng.abort(rid)
        for d in eng.step():
            got[d.rid].extend(d.token_ids)
        steps += 1
    eng.step()
    assert eng.scheduler.stats["mixed_steps"] > 0 and eng.scheduler.stats["retractions"] > 0
    assert eng.kv.all_free
    eng.kv.check()
    for rid, ref in zip(rids, want):
        if rid not in doomed:
            assert got[rid] == ref, rid


def test_speculative_workers_do_not_mix(models):  # noqa: F811
    _, modes, _ = staggered(make_engine(models, "eagle", tpot_guard_ms=25.0, mixed_chunk=True))
    assert M not in modes


# ---- what the guard and the rates make of it ----
def test_a_mixed_chunk_takes_what_the_step_leaves_of_the_guard():
    from engine.scheduler.tpot_guard import STARVE_STEPS, TpotGuard

    rates = FixedRates(prefill=10_000.0, step=0.01, overhead=0.02, mixed=20_000.0)
    guard = TpotGuard(0.03, rates, max_chunk=4096)
    decoding = [_req("a", 0, max_new=2)]  # slack: 2 tokens x (30 ms - 10.1 ms) = 39.8 ms
    # separate: (slack - fixed part) x prompt rate = 198 tokens, not worth its fixed part: none
    assert guard.chunk_tokens(decoding, 4096, now=0.0) == 0
    # inside the step: the 19.9 ms the step (10.1 ms) leaves of the 30 ms guard, at the mixed rate,
    # every step alike, however much slack the requests hold
    for _ in range(3):
        assert guard.chunk_tokens(decoding, 4096, now=0.0, mixed=True) == int(0.0199 * 20_000)
    assert guard.chunk_tokens([_req("b", 0, max_new=1000)], 4096, now=0.0, mixed=True) == int(0.0199 * 20_000)
    # a step that fills the guard leaves nothing: the prompt waits, then advances by the smallest
    # chunk whose marginal rate the node measures (so a rate read low is read again)
    full = TpotGuard(0.01, rates, max_chunk=4096)
    assert all(full.chunk_tokens(decoding, 4096, now=0.0, mixed=True) == 0 for _ in range(STARVE_STEPS))
    assert full.chunk_tokens(decoding, 4096, now=0.0, mixed=True) == MIXED_MIN_TOKENS


def test_a_mixed_chunk_is_cut_to_a_graph_bucket_unless_it_finishes_the_prompt():
    from engine.config import EngineConfig, mixed_chunk_sizes
    from engine.scheduler.policy import fit_chunk

    sizes = (64, 128, 256, 384, 512)
    assert fit_chunk(330, 2048, sizes) == 256  # padded to 384 it would cost more than the guard gave
    assert fit_chunk(330, 300, sizes) == 330  # the prompt's rest fits: all of it
    assert fit_chunk(40, 2048, sizes) == 40 and fit_chunk(0, 2048, sizes) == 0  # under the smallest
    assert fit_chunk(512, 4096, sizes) == 512 and fit_chunk(700, 4096, ()) == 700
    mixing = EngineConfig("m", mixed_chunk=True, tpot_guard_ms=12.0, cuda_graph_max_bs=64, cuda_graph_prompt_tokens=256)
    assert mixed_chunk_sizes(mixing) == (64, 128, 256)
    assert mixed_chunk_sizes(dataclasses.replace(mixing, cuda_graph_max_bs=0)) == ()  # eager: any size
    assert mixed_chunk_sizes(dataclasses.replace(mixing, mixed_chunk=False)) == ()  # not mixing


def test_rates_learn_a_mixed_chunks_marginal_rate():
    rates = NodeRates()
    for _ in range(3):
        rates.observe(D, 8, 8, 0.010)
    rates.observe_mixed(8, 256, 8, 0.010 + 256 / 50_000)
    rates.observe_mixed(8, 16, 8, 0.5)  # too few tokens to tell
    assert rates.mixed_tokens_per_s() == pytest.approx(50_000, rel=1e-3)
    assert rates.snapshot(8)["mixed_tokens_per_s"] == pytest.approx(50_000, rel=1e-3)
    assert rates.recent_prompt_tokens_per_s() > 0 and rates.recent_decode_tokens_per_s() > 0


def test_a_mixed_chunks_rate_is_bounded_by_the_prompt_path(caplog):
    """One stalled mixed step (a compile, a host pause) must not set the mixed rate below what the
    chunk would cost as its own prompt batch: that reading made every chunk too small to measure.
    Nor may an overpriced decode step set it past MIXED_MAX_SPEEDUP x the prompt rate."""
    rates = NodeRates()
    for _ in range(3):
        rates.observe(D, 8, 8, 0.010)
    rates.observe(X, 1, 2048, 2048 / 40_000)  # the prompt rate: 40K tokens/s
    rates.observe(X, 1, 32, 0.005 + 32 / 40_000)  # its fixed part: 5 ms
    with caplog.at_level("WARNING", logger="engine.scheduler.rates"):
        rates.observe_mixed(8, 128, 8, 0.010 + 0.200)  # 200 ms for 128 tokens: a stall
    apart = 0.005 + 128 / 40_000
    assert rates.mixed_tokens_per_s() == pytest.approx(128 / apart, rel=1e-3)
    assert "more than the chunk costs apart" in caplog.text
    for _ in range(4):  # steps at the real marginal rate outvote it (a median)
        rates.observe_mixed(8, 256, 8, 0.010 + 256 / 60_000)
    assert rates.mixed_tokens_per_s() == pytest.approx(60_000, rel=1e-3)
    for _ in range(9):  # a decode step priced above its cost reads the chunk impossibly fast
        rates.observe_mixed(8, 256, 8, 0.010 + 256 / 500_000)
    assert rates.mixed_tokens_per_s() == pytest.approx(MIXED_MAX_SPEEDUP * 40_000, rel=1e-3)


def test_a_mixed_rate_read_long_ago_is_forgotten(monkeypatch):
    """The mixed rate is measured only while local prompts run, and the router sends them only
    while that rate is good: a low reading must fade, or it keeps every prompt off the node for good."""
    rates = NodeRates()
    for _ in range(3):
        rates.observe(D, 8, 8, 0.010)
    rates.observe_mixed(8, 256, 8, 0.010 + 256 / 10_000)
    now = time.monotonic()
    assert rates.mixed_tokens_per_s(now) == pytest.approx(10_000, rel=1e-3)
    assert rates.mixed_tokens_per_s(now + MIXED_FRESH_S + 1) == 0.0  # the prompt rate stands in
    later = time.monotonic() + MIXED_FRESH_S + 1
    with monkeypatch.context() as patch:  # measured again, that long after the first reading
        patch.setattr(rates_module.time, "monotonic", lambda: later)
        rates.observe_mixed(8, 256, 8, 0.010 + 256 / 50_000)
    assert rates.mixed_tokens_per_s(later) == pytest.approx(50_000, rel=1e-3)  # the old one is gone


# ---- GPU: captured mixed graphs ----
@pytest.fixture(scope="module")
def gpu_rig(tiny_llama_dir, head_dir) -> Rig:
    rig = Rig(tiny_llama_dir, head_dir, device="cuda", dtype="bfloat16", backend="triton")
    assert rig.target.enable_cuda_graphs(64, prompt_tokens=512, mixed_chunk_tokens=512)
    return rig


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 7), (3, 100), (33, 300), (64, 512)])
def test_gpu_mixed_graphs_equal_eager(gpu_rig, shape) -> None:
    d, chunk = shape
    reqs = gpu_rig.requests(d, 1) + gpu_rig.requests(1, chunk)  # decode steps, then the chunk's request
    prefix = [len(r.prompt_ids) for r in reqs]
    extend = [1] * d + [chunk]
    try:
        check_graph(gpu_rig.target, lambda: mixed(gpu_rig.target, gpu_rig, reqs, prefix, extend, d))
    finally:
        gpu_rig.release(reqs)
