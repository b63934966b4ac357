"""min_new_tokens (and logit_bias) under speculation: every verify row is masked by the output number
it samples, so greedy speculative output (chain, tree, n-gram, overlapped) equals greedy plain output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.core import FinishReason, Req, SamplingParams
from engine.engine import Engine, EngineConfig
from engine.sampler import Sampler
from spec.verify_step import verify_window
from spec.config import SpecConfig
from spec.registry import bind
from spec.tree import DraftTree, child_links

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121))]
MIN, MAX = 12, 24


def _engine(target: object, spec: SpecConfig | None, **kw: object) -> Engine:
    cfg = EngineConfig(str(target), page_size=4, chunked_prefill_size=7, **kw)  # type: ignore[arg-type]
    return Engine(cfg, algorithm=bind(spec) if spec else None)


@pytest.fixture(scope="module")
def params(pair) -> SamplingParams:  # type: ignore[no-untyped-def]
    """Greedy, with stop token ids the plain output reaches early (without min_new_tokens every
    prompt stops within 3 tokens) plus the ones it reaches just after MIN once those are banned."""
    eng = _engine(pair[0], None)
    free = SamplingParams(max_new_tokens=MAX, temperature=0.0, ignore_eos=True)
    stops = {o.output_ids[2] for o in eng.generate(PROMPTS, free)}
    banned = dataclasses.replace(free, stop_token_ids=tuple(sorted(stops)), min_new_tokens=MIN)
    stops |= {o.output_ids[MIN + 1] for o in eng.generate(PROMPTS, banned)}
    early = eng.generate(PROMPTS, dataclasses.replace(free, stop_token_ids=tuple(sorted(stops))))
    assert all(len(o.output_ids) <= 3 and o.finish_reason is FinishReason.STOP for o in early)
    return dataclasses.replace(banned, stop_token_ids=tuple(sorted(stops)))


@pytest.fixture(scope="module")
def plain(pair, params: SamplingParams) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outs = _engine(pair[0], None).generate(PROMPTS, params)
    for o in outs:  # no stop token before MIN; a stop token at MIN or later ends the request
        assert len(o.output_ids) >= MIN
        assert not set(o.output_ids[:MIN]) & set(params.stop_token_ids)
        assert (o.finish_reason is FinishReason.LENGTH) == (len(o.output_ids) == MAX)
    assert any(o.finish_reason is FinishReason.STOP for o in outs), "no stop after MIN: a weak test"
    return [o.output_ids for o in outs]


SPECS = {
    "eagle-chain": lambda head: (SpecConfig("EAGLE", str(head), 3, 1), {}),
    "eagle-tree": lambda head: (SpecConfig("EAGLE", str(head), 3, 2, 5), {}),
    "eagle-overlap": lambda head: (SpecConfig("EAGLE", str(head), 3, 2, 5), {"overlap": True}),
    "ngram": lambda head: (SpecConfig("NGRAM", num_steps=3), {}),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_spec_with_min_tokens_equals_plain(pair, params, plain, name) -> None:  # type: ignore[no-untyped-def]
    spec, kw = SPECS[name](pair[1])
    eng = _engine(pair[0], spec, **kw)
    assert [o.output_ids for o in eng.generate(PROMPTS, params)] == plain
    assert eng.executor.stats.verifies > 0
    eng.step()  # overlap: the last batch in flight
    assert eng.kv.all_free


def test_verify_window_bans_each_tree_row_by_its_depth() -> None:
    """A tree's row j sits at depth d <= j: it samples output n + d + 1, not n + j + 1. Rows
    [root, a=7, b=11, c=20, d=11], b and d at depths 1 and 2; every row's logits favour EOS,
    then 11. With 2 outputs and min 4, outputs 3 and 4 (depths 0, 1) may not be EOS: the walk
    accepts b and d and ends with EOS as output 5. Banning by row index would let EOS out at b."""
    eos, vocab = 1, 32
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    first, sib = child_links(parents, torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6]]))
    tree = DraftTree(torch.tensor([[5, 7, 11, 20, 11]]), parents, torch.tensor([[0, 1, 1, 2, 2]]), first, sib, False)
    req = Req(
        "r", [2, 3, 4], SamplingParams(max_new_tokens=9, min_new_tokens=4, temperature=0.0), output_ids=[6, 5], slot=1
    )
    logits = torch.zeros(5, vocab)
    logits[:, eos], logits[:, 11] = 10.0, 9.0
    seq_lens = torch.tensor([len(req.prompt_ids) + len(req.output_ids) - 1])
    vr = verify_window(Sampler(vocab, 4, "cpu", eos_token_ids=[eos]), [req], tree, logits, seq_lens)
    assert vr.accept_lens.tolist() == [3] and vr.emitted[0, :3].tolist() == [11, 11, eos]


def test_greedy_spec_with_logit_bias_equals_plain(pair) -> None:  # type: ignore[no-untyped-def]
    plain = _engine(pair[0], None)
    free = SamplingParams(max_new_tokens=MAX, temperature=0.0, ignore_eos=True)
    first = [o.output_ids for o in plain.generate(PROMPTS, free)]
    # push the plain path off its tracks: ban what it said second, favour a token mildly
    biased = dataclasses.replace(free, logit_bias=tuple(sorted({(o[1], -100.0) for o in first} | {(77, 3.0)})))
    want = [o.output_ids for o in plain.generate(PROMPTS, biased)]
    assert want != first
    for name in ("eagle-chain", "eagle-tree", "ngram"):
        spec, kw = SPECS[name](pair[1])
        assert [o.output_ids for o in _engine(pair[0], spec, **kw).generate(PROMPTS, biased)] == want, name
