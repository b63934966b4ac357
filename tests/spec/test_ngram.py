"""N-gram prompt lookup end to end on CPU: greedy equals plain, acceptance, seeds, aborts, PD handoff."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from engine.core import Batch, FinishReason, ForwardMode, Req, SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig, SpecConfigError
from engine.future_map import FutureMap
from spec.draft_input import BonusDraftInput
from spec.ngram import NgramAlgo, propose_drafts
from spec.registry import SpeculativeAlgorithm, bind

SNIPPET = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
OTHER_PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [8, 1], list(range(100, 121))]
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
NGRAM = SpecConfig("NGRAM", num_steps=3)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # seed 1 falls into loops on some prompts, so lookup drafts get accepted there
    return write_tiny_model(tmp_path_factory.mktemp("target") / "t", seed=1)


def engine(target, spec: SpecConfig | None = NGRAM, **kw) -> Engine:
    cfg = EngineConfig(str(target), page_size=4, chunked_prefill_size=7, **kw)
    return Engine(cfg, algorithm=bind(spec) if spec else None)


@pytest.fixture(scope="module")
def prompts(target):
    tok = engine(target, None).tokenizer
    assert tok is not None
    return [tok.encode(SNIPPET * 4), *OTHER_PROMPTS]  # the repeated code snippet first


@pytest.fixture(scope="module")
def plain_greedy(target, prompts):
    return [o.output_ids for o in engine(target, None).generate(prompts, GREEDY)]


def test_prompt_lookup_prefers_the_longest_most_recent_match():
    assert propose_drafts([1, 2, 3, 4, 9, 1, 2, 3], 3, 1, 4) == [4, 9, 1]
    # "1 2 3" (length 3) beats the more recent single "3"
    assert propose_drafts([1, 2, 3, 9, 3, 5, 1, 2, 3], 2, 1, 4) == [9, 3]
    assert propose_drafts([7, 1, 7, 2, 7], 1, 1, 1) == [2]  # most recent earlier occurrence
    assert propose_drafts([1, 2, 1, 2, 1, 2], 3, 1, 4) == [1, 2, 1]  # a period keeps going
    assert propose_drafts([5, 6, 7], 3, 1, 4) == []
    assert propose_drafts([1, 2, 3, 9, 3, 5, 1, 2, 3], 2, 4, 4) == []  # below ngram_min


def test_greedy_ngram_equals_greedy_plain(target, prompts, plain_greedy):
    eng = engine(target)
    outs = eng.generate(prompts, GREEDY)
    assert [o.output_ids for o in outs] == plain_greedy
    # the repeated snippet: drafts are accepted
    hist = Counter(outs[0].accepted_drafts)
    assert sum(a * n for a, n in hist.items()) > 0, hist
    for o in outs:  # each verify emits accepted drafts + 1 bonus; max_new_tokens may cut the last
        emitted = sum(a + 1 for a in o.accepted_drafts)
        assert len(o.output_ids) - 1 <= emitted <= len(o.output_ids) - 1 + NGRAM.num_steps
    stats = eng.executor.stats
    assert stats.verifies > 0 and any(a > 1 for a in stats.accept_len_hist)
    assert 1.0 < stats.mean_accept_len <= NGRAM.num_steps + 1
    assert eng.kv.all_free
    eng.kv.check()


def test_logprobs_match_plain(target, prompts):
    p = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    want = engine(target, None).generate(prompts[:2], p)
    got = engine(target).generate(prompts[:2], p)
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_seeded_sampling_with_ngram_is_reproducible(target, prompts):
    eng = engine(target)
    p = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    a = eng.generate([prompts[0]], p)[0].output_ids
    b = eng.generate([prompts[1], prompts[0]], [GREEDY, p])[1].output_ids
    c = engine(target).generate([prompts[0]], p)[0].output_ids
    assert a == b == c and len(a) == 24
    other = eng.generate([prompts[0]], SamplingParams(max_new_tokens=24, temperature=0.8, seed=8, ignore_eos=True))[
        0
    ].output_ids
    assert other != a


def test_random_aborts_during_ngram_decoding_free_every_page(target, prompts):
    eng = engine(target, max_total_tokens=200, max_running=6)
    rng = random.Random(5)
    tokens = prompts[0]
    live, reasons = set(), []

    def drain() -> None:
        for d in eng.step():
            if d.finished:
                live.discard(d.rid)
                reasons.append(d.finish_reason)

    for step in range(250):
        if step < 150 and rng.random() < 0.3:
            start = rng.randrange(0, len(tokens) - 30)
            prompt = (
                tokens[start : start + rng.randrange(1, 30)]
                if rng.random() < 0.5
                else [rng.randrange(1, 500) for _ in range(rng.randrange(1, 25))]
            )
            live.add(
                eng.add_request(
                    prompt, SamplingParams(max_new_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.9]))
                )
            )
        if live and rng.random() < 0.08:
            eng.abort(rng.choice(sorted(live)))
        drain()
    while not eng.idle:
        drain()
    assert not live and FinishReason.ABORT in reasons
    assert eng.executor.spec_stats().verifies > 0
    assert eng.kv.all_free
    eng.kv.check()


def _prebuilt(reqs: list[Req]) -> Batch:
    return Batch(ForwardMode.PREBUILT, reqs, [0] * len(reqs), [False] * len(reqs))


def test_disagg_draft_input_relays_only_the_bonus_token():
    algo = SpeculativeAlgorithm.from_name("ngram")
    assert isinstance(algo, NgramAlgo)
    assert not algo.needs_draft_model() and not algo.carries_draft_hidden_states()
    fm = algo.create_future_map(7, 2048, 1024, "cpu", debug=True)
    assert not fm.need_topk and not fm.need_hidden
    reqs = [Req(f"r{i}", [1, 2, 3, i], SamplingParams(), output_ids=[40 + i]) for i in range(2)]
    for slot, req in zip((3, 5), reqs):
        req.slot, req.seq_len, req.spec_state = slot, 4, "stale"
    di = algo.build_disagg_draft_input(_prebuilt(reqs), NGRAM, torch.tensor([40, 41]), fm)
    assert isinstance(di, BonusDraftInput) and len(di) == 2
    assert di.bonus_tokens.tolist() == [40, 41] and di.future_indices.tolist() == [3, 5]
    assert all(r.spec_state is None for r in reqs)
    idx = torch.tensor([3, 5])
    assert fm.resolve_seq_lens(idx).tolist() == [4, 4]
    assert fm.resolve(idx).bonus_tokens.tolist() == [40, 41]
    # without a FutureMap (colocated / non-overlap) it is just the draft input
    assert algo.build_disagg_draft_input(_prebuilt(reqs), NGRAM, [40, 41], None).future_indices is None


def test_disagg_draft_input_refuses_bad_input():
    algo = SpeculativeAlgorithm.from_name("NGRAM")
    with pytest.raises(ValueError, match="no requests"):
        algo.build_disagg_draft_input(_prebuilt([]), NGRAM, torch.tensor([], dtype=torch.int64), None)
    req = Req("r", [1, 2], SamplingParams(), output_ids=[9])
    with pytest.raises(ValueError, match="one bonus token per request"):
        algo.build_disagg_draft_input(_prebuilt([req]), NGRAM, [9, 9], None)
    with pytest.raises(ValueError, match="no KV slot"):
        algo.build_disagg_draft_input(
            _prebuilt([req]), NGRAM, [9], FutureMap(4, "cpu", need_topk=False, need_hidden=False)
        )
    with pytest.raises(SpecConfigError, match="--speculative-eagle-topk"):
        algo.build_disagg_draft_input(_prebuilt([req]), SpecConfig("NGRAM", eagle_topk=2), [9], None)


def test_tree_drafts_are_refused(target):
    with pytest.raises(SpecConfigError, match="--speculative-eagle-topk"):
        engine(target, SpecConfig("NGRAM", num_steps=3, eagle_topk=2))
    assert engine(target).executor.kv_tokens_per_decode() == NGRAM.num_steps + 1
