"""EAGLE / EAGLE-3 end to end on CPU: greedy speculative output equals greedy plain output."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine.config import ModelLoadError
from engine.core import FinishReason, SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [8, 1], list(range(100, 121)), [300] * 5]
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # seed 1 falls into loops now and then, so a "repeat" head gets accepted at every length
    return write_tiny_model(tmp_path_factory.mktemp("target") / "t", seed=1)


@pytest.fixture(scope="module")
def plain_greedy(target):
    eng = Engine(EngineConfig(str(target), page_size=4, chunked_prefill_size=7))
    return [o.output_ids for o in eng.generate(PROMPTS, GREEDY)]


def spec_engine(target, head, algo, steps, topk, ntok=None, **kw):
    cfg = SpecConfig(algo, str(head), steps, topk, ntok)
    return Engine(EngineConfig(str(target), page_size=4, chunked_prefill_size=7, **kw), algorithm=bind(cfg))


CASES = [  # fmt, head mode, steps, topk, draft tokens
    ("eagle", "repeat", 3, 1, None),
    ("eagle", "random", 3, 1, None),
    ("eagle", "repeat", 3, 2, 5),
    ("eagle", "repeat", 4, 3, 8),
    ("eagle3", "random", 3, 1, None),
    ("eagle3", "random", 3, 4, 8),
]


@pytest.mark.parametrize("fmt,mode,steps,topk,ntok", CASES)
def test_greedy_spec_equals_greedy_plain(tmp_path, target, plain_greedy, fmt, mode, steps, topk, ntok):
    head = write_tiny_eagle_head(
        tmp_path / "head", target, fmt, mode=mode, draft_vocab_size=300 if fmt == "eagle3" else None
    )
    eng = spec_engine(target, head, "EAGLE3" if fmt == "eagle3" else "EAGLE", steps, topk, ntok)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == plain_greedy
    stats = eng.executor.stats
    assert stats.verifies > 0 and 1.0 <= stats.mean_accept_len <= steps + 1
    assert eng.kv.all_free
    eng.kv.check()


def test_chain_accepts_every_length_and_counts_target_forwards(tmp_path, target, plain_greedy):
    head = write_tiny_eagle_head(tmp_path / "head", target, "eagle", mode="repeat")
    eng = spec_engine(target, head, "EAGLE", 3, 1)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == plain_greedy
    assert set(eng.executor.stats.accept_len_hist) == {1, 2, 3, 4}
    for o in outs:  # accepted drafts + one bonus per verify cover the output (the last may be cut)
        emitted = sum(a + 1 for a in o.accepted_drafts)
        assert len(o.output_ids) - 1 <= emitted <= len(o.output_ids) - 1 + 3


def test_aborts_and_retractions_under_spec_free_every_page(tmp_path, target):
    head = write_tiny_eagle_head(tmp_path / "head", target, "eagle", mode="repeat")
    eng = spec_engine(target, head, "EAGLE", 3, 2, 5, max_total_tokens=200, max_running=6)
    rng = random.Random(3)
    live, reasons = set(), []
    for step in range(250):
        if step < 150 and rng.random() < 0.3:
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 25))]
            live.add(
                eng.add_request(
                    prompt, SamplingParams(max_new_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.9]))
                )
            )
        if live and rng.random() < 0.08:
            eng.abort(rng.choice(sorted(live)))
        for d in eng.step():
            if d.finished:
                live.discard(d.rid)
                reasons.append(d.finish_reason)
    while not eng.idle:
        for d in eng.step():
            if d.finished:
                live.discard(d.rid)
                reasons.append(d.finish_reason)
    assert not live and FinishReason.ABORT in reasons
    assert eng.kv.all_free
    eng.kv.check()


def test_seeded_sampling_with_spec_is_reproducible(tmp_path, target):
    head = write_tiny_eagle_head(tmp_path / "head", target, "eagle3", draft_vocab_size=300)
    eng = spec_engine(target, head, "EAGLE3", 3, 2, 5)
    p = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=7)
    a = eng.generate([PROMPTS[0]], p)[0].output_ids
    b = eng.generate([PROMPTS[1], PROMPTS[0]], [GREEDY, p])[1].output_ids
    assert a == b and len(a) == 20


def test_prefill_leaves_the_handoff_state_on_the_request(tmp_path, target):
    """A PD prefill request (hold_kv) keeps its draft state for the aux row; every request's
    state is also in its FutureMap row, which is all an ordinary request keeps."""
    head = write_tiny_eagle_head(tmp_path / "head", target, "eagle", mode="random")
    eng = spec_engine(target, head, "EAGLE", 3, 2, 5)
    held = eng.make_request(PROMPTS[2], SamplingParams(max_new_tokens=5, temperature=0.0), "held")
    held.hold_kv = True
    eng.io.submit(held)
    plain = eng.make_request(PROMPTS[0], SamplingParams(max_new_tokens=5, temperature=0.0), "plain")
    eng.io.submit(plain)
    while not held.output_ids or not plain.output_ids:  # the prompt is prefilled in chunks of 7
        eng.step()
    st = held.spec_state
    assert held.seq_len == len(PROMPTS[2]) and len(held.output_ids) == 1  # the bonus has no KV yet
    assert st.topk_p.shape == (2,) and st.topk_index.shape == (2,)
    assert st.hidden.shape == (eng.model_config.hidden_size,)
    assert float(st.topk_p.sum()) <= 1.0 + 1e-5
    assert plain.spec_state is None
    fm = eng.executor.future_map
    row = torch.tensor([held.slot])
    assert fm.resolve_seq_lens(row).tolist() == [len(PROMPTS[2])]
    relay = fm.resolve(row)
    assert relay.bonus_tokens.tolist() == held.output_ids
    assert torch.equal(relay.topk_index[0], st.topk_index) and torch.equal(relay.hidden_states[0], st.hidden)


def _with_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_heads_that_do_not_fit_the_target_are_refused(tmp_path, target):
    other = write_tiny_model(tmp_path / "wide", seed=0, hidden_size=96, num_heads=4, num_kv_heads=2)
    wide_head = write_tiny_eagle_head(tmp_path / "wide_head", other, "eagle")
    with pytest.raises(ModelLoadError, match="hidden_size 96"):
        spec_engine(target, wide_head, "EAGLE", 3, 1)
    head = write_tiny_eagle_head(tmp_path / "head", target, "eagle")
    bad_vocab = _with_config(head, tmp_path / "bad_vocab", vocab_size=1000)
    with pytest.raises(ModelLoadError, match="vocab_size 1000"):
        spec_engine(target, bad_vocab, "EAGLE", 3, 1)
    wide3 = write_tiny_eagle_head(tmp_path / "wide3", other, "eagle3", draft_vocab_size=100)
    with pytest.raises(ModelLoadError, match="hidden_size 96"):
        spec_engine(target, wide3, "EAGLE3", 3, 1)
    big_vocab3 = write_tiny_eagle_head(tmp_path / "big3", target, "eagle3")
    _with_config(big_vocab3, tmp_path / "big3b", draft_vocab_size=100000)
    with pytest.raises(ModelLoadError, match="draft_vocab_size 100000"):
        spec_engine(target, tmp_path / "big3b", "EAGLE3", 3, 1)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        spec_engine(target, head, "EAGLE3", 3, 1)  # an EAGLE-1 head where EAGLE-3 is expected


def test_unset_kv_capacity_is_sized_for_target_and_draft(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no --max-total-tokens the cache is sized for both models' KV per token, and the head's
    weights (loaded after the cache) count as used."""
    import engine.build as engine_mod
    from engine.config import ModelConfig
    from engine.kv_budget import draft_footprint, kv_bytes_per_token

    target, head = pair
    seen: list[tuple] = []
    monkeypatch.setattr(engine_mod, "size_kv_cache", lambda *args: seen.append(args) or 64)
    eng = spec_engine(target, head, "EAGLE", 3, 1, 4, max_total_tokens=None, mem_fraction_static=0.5)
    tc = ModelConfig.from_dir(target)
    size = eng.dtype.itemsize
    draft_per_token, draft_weights = draft_footprint(str(head), size)
    assert draft_per_token > 0 and draft_weights > 0
    per_token = kv_bytes_per_token(tc.num_layers, tc.num_kv_heads, tc.head_dim, size) + draft_per_token
    assert seen == [(eng.device, 0.5, eng.config.page_size, per_token, draft_weights)]
    assert eng.kv.allocator.total * eng.kv.page_size == 64
