"""Every output token carries the target's logprob and top-k, whatever produced it: the prefill's
first token (through the PD handoff), accepted drafts and bonus tokens under speculation. They
equal plain colocated decoding's within float tolerance, and at temperature 0 the chosen token
is the top-1. Every algorithm (plugins included), colocated and PD, overlap off and on."""

from __future__ import annotations

import importlib.util

import pytest

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind
from spec.testing import InProcessPD

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121))]
PARAMS = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=4)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = write_tiny_model(root / "t", seed=1)
    return {
        "target": target,
        "EAGLE": write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat"),
        "EAGLE3": write_tiny_eagle_head(root / "h3", target, "eagle3", draft_vocab_size=300),
        "STANDALONE": write_tiny_model(root / "d", seed=1),
    }


def _spec(models, algo: str) -> SpecConfig:
    if algo in ("NONE", "NGRAM"):
        return SpecConfig(algo)
    return SpecConfig(algo, str(models[algo]), 3, 1)


def _engine(models, algo: str | None, **kw) -> Engine:
    binding = bind(_spec(models, algo)) if algo else None
    return Engine(EngineConfig(str(models["target"]), page_size=4, **kw), algorithm=binding)


def _check(got: list[tuple[list[int], list[float], list]], want) -> None:
    for (ids, lp, top), (wids, wlp, wtop) in zip(got, want):
        assert ids == wids and len(lp) == len(ids) == len(top)
        assert max(abs(a - b) for a, b in zip(lp, wlp)) < TOL
        for t, w, tok in zip(top, wtop, ids):
            assert [i for i, _ in t] == [i for i, _ in w] and t[0][0] == tok  # greedy: top-1 chosen
            assert max(abs(a - b) for (_, a), (_, b) in zip(t, w)) < TOL


ALGOS = ["NONE", "EAGLE", "EAGLE3", "NGRAM", "STANDALONE"]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("overlap", [False, True])
def test_colocated_logprobs_equal_plain(models, algo: str, overlap: bool) -> None:
    if algo == "STANDALONE" and importlib.util.find_spec("pdserve_standalone") is None:
        pytest.skip("pip install ./examples/standalone (make test does)")
    want = [(o.output_ids, o.logprobs, o.top_logprobs) for o in _engine(models, None).generate(PROMPTS, PARAMS)]
    eng = _engine(models, algo, overlap=overlap)
    _check([(o.output_ids, o.logprobs, o.top_logprobs) for o in eng.generate(PROMPTS, PARAMS)], want)


@pytest.mark.parametrize("algo", ALGOS)
def test_pd_logprobs_equal_plain_including_the_first_token(models, algo: str) -> None:
    if algo == "STANDALONE" and importlib.util.find_spec("pdserve_standalone") is None:
        pytest.skip("pip install ./examples/standalone (make test does)")
    want = [(o.output_ids, o.logprobs, o.top_logprobs) for o in _engine(models, None).generate(PROMPTS, PARAMS)]
    binding = bind(_spec(models, algo))
    prefill, decode = _engine(models, algo), _engine(models, algo)
    pd = InProcessPD(prefill, decode, binding)
    try:
        got: dict[str, tuple[list[int], list[float], list]] = {}
        for i, prompt in enumerate(PROMPTS):
            req = pd.hand_off(prompt, f"r{i}", PARAMS)
            got[req.rid] = ([], [], [])
            pd.adopt(req)
        while not decode.idle:
            for d in decode.step():
                ids, lp, top = got[d.rid]
                ids += d.token_ids
                lp += d.logprobs
                top += d.top_logprobs
        _check([got[f"r{i}"] for i in range(len(PROMPTS))], want)
        pd.check_returned()
    finally:
        pd.close()
