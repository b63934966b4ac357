"""Grammar-constrained decoding stays exact under speculation and across the handoff: for every
algorithm (EAGLE chain and tree, EAGLE-3, n-gram, the out-of-tree plugin), overlap off and on,
greedy constrained output equals plain constrained output, colocated and in-process PD; sampled
constrained output conforms; every page returns."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from common.sampling import Constraint
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind
from spec.testing import InProcessPD

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    Constraint("regex", "(yes|no|maybe)"),
    Constraint("json_schema", json.dumps(SCHEMA)),
    Constraint("regex", "[a-f]{3,12}"),
    Constraint("ebnf", 'root ::= "[" item ("," item)* "]"\nitem ::= "1" | "22" | "333"'),
]
PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121)), [8, 1]]
GREEDY = [SamplingParams(max_new_tokens=32, temperature=0.0, constraint=c) for c in CONSTRAINTS]
FREE = SamplingParams(max_new_tokens=10, temperature=0.0)
SAMPLED = [
    SamplingParams(max_new_tokens=32, temperature=0.8, seed=7 + i, constraint=c) for i, c in enumerate(CONSTRAINTS)
]
ALGOS = {
    "EAGLE": ("EAGLE", 3, 1, None),
    "EAGLE-tree": ("EAGLE", 3, 2, 6),
    "EAGLE3": ("EAGLE3", 3, 1, None),
    "NGRAM": ("NGRAM", 3, 1, None),
    "STANDALONE": ("STANDALONE", 3, 1, None),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar-spec")
    target = write_tiny_model(root / "t", seed=1)
    return {
        "target": target,
        "EAGLE": write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat"),
        "EAGLE3": write_tiny_eagle_head(root / "h3", target, "eagle3", draft_vocab_size=300),
        "STANDALONE": write_tiny_model(root / "d", seed=1),
    }


def _spec(models, name: str) -> SpecConfig:
    algo, steps, topk, ntok = ALGOS[name]
    if algo == "NGRAM":
        return SpecConfig(algo, num_steps=steps)
    return SpecConfig(algo, str(models[algo]), steps, topk, ntok)


def _engine(models, name: str | None, **kw) -> Engine:
    if name == "STANDALONE" and importlib.util.find_spec("pdserve_standalone") is None:
        pytest.skip("pip install ./examples/standalone (make test does)")
    binding = bind(_spec(models, name)) if name else None
    return Engine(EngineConfig(str(models["target"]), page_size=4, **kw), algorithm=binding)


def conforms(text: str, c: Constraint) -> bool:
    if c.kind == "json_schema":
        obj = json.loads(text)
        return set(obj) == {"ok", "pick"} and isinstance(obj["ok"], bool)
    if c.kind == "ebnf":
        return re.fullmatch(r"\[(1|22|333)(,(1|22|333))*\]", text) is not None
    return re.fullmatch(c.spec, text) is not None


def assert_follows(eng: Engine, o, c: Constraint) -> None:
    """The whole output is in the grammar; a finished one matches it completely."""
    assert eng.grammars is not None
    assert eng.grammars.matcher(c).validate(o.output_ids) == len(o.output_ids), o.text
    if o.finish_reason.value == "stop":
        assert conforms(o.text, c), o.text
    else:
        assert o.finish_reason.value == "length", o


def _assert_returned(eng: Engine) -> None:
    assert not eng.scheduler.has_work and eng.kv.all_free
    eng.kv.check()


@pytest.fixture(scope="module")
def plain(models):
    """The oracle: constrained greedy output without speculation (and an unconstrained neighbour)."""
    eng = _engine(models, None)
    outs = eng.generate(PROMPTS + PROMPTS[:1], GREEDY + [FREE])
    for o, p in zip(outs, GREEDY):
        assert p.constraint is not None
        assert_follows(eng, o, p.constraint)
    assert sum(o.finish_reason.value == "stop" for o in outs) >= 3  # the grammars end the requests
    return [o.output_ids for o in outs]


@pytest.mark.parametrize("name", sorted(ALGOS))
@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_constrained_spec_equals_plain(models, plain, name: str, overlap: bool) -> None:
    eng = _engine(models, name, overlap=overlap)
    outs = eng.generate(PROMPTS + PROMPTS[:1], GREEDY + [FREE])
    assert [o.output_ids for o in outs] == plain
    _assert_returned(eng)


@pytest.mark.parametrize("name", ["EAGLE", "EAGLE-tree", "NGRAM"])
def test_sampled_constrained_spec_conforms(models, name: str) -> None:
    eng = _engine(models, name)
    for o, p in zip(eng.generate(PROMPTS, SAMPLED), SAMPLED):
        assert p.constraint is not None
        assert_follows(eng, o, p.constraint)
    _assert_returned(eng)


@pytest.mark.parametrize("name", [None, *sorted(ALGOS)])
@pytest.mark.parametrize("overlap", [False, True])
def test_pd_constrained_equals_colocated(models, plain, name: str | None, overlap: bool) -> None:
    binding = bind(_spec(models, name) if name else SpecConfig("NONE"))
    prefill, decode = _engine(models, name, overlap=overlap), _engine(models, name, overlap=overlap)
    pd = InProcessPD(prefill, decode, binding)
    try:
        res = pd.run(PROMPTS + PROMPTS[:1], GREEDY + [FREE])
        assert [res.tokens[f"r{i}"] for i in range(len(PROMPTS) + 1)] == plain
        pd.check_returned()
    finally:
        pd.close()


@pytest.mark.parametrize("name", ["EAGLE", "EAGLE3", "NGRAM", "STANDALONE"])
def test_forced_tokens_are_offered_as_drafts(models, plain, name: str) -> None:
    """Jump-forward as a draft source: the JSON's keys and punctuation the schema forces are
    drafted and accepted, so the object takes far fewer verifies than tokens (same output)."""
    eng = _engine(models, name)
    [o] = eng.generate(PROMPTS[1:2], GREEDY[1:2])
    assert o.output_ids == plain[1] and o.finish_reason.value == "stop"
    assert sum(o.accepted_drafts) >= len(o.output_ids) // 2
    assert len(o.accepted_drafts) < len(o.output_ids) // 2


@pytest.mark.parametrize("name", ["EAGLE", "NGRAM"])
def test_xgrammar_backend_is_exact_under_speculation_too(models, name: str) -> None:
    want = _engine(models, None, grammar_backend="xgrammar").generate(PROMPTS, GREEDY)
    eng = _engine(models, name, grammar_backend="xgrammar", overlap=True)
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in want]
    assert sum(outs[1].accepted_drafts) >= len(outs[1].output_ids) // 2  # its jump-forward string, drafted
    _assert_returned(eng)


def _with_graphs(eng: Engine) -> Engine:
    """The start-up graphs of a GPU node, run uncaptured on their padded buffers (the CPU's way)."""
    worker = eng.executor
    worker.target.enable_cuda_graphs(4, capture=False)
    worker.draft.enable_cuda_graphs(4, capture=False)
    worker.capture_cuda_graphs()
    return eng


@pytest.mark.parametrize("name", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_iteration_graphs_equal_eager(models, plain, name: str, overlap: bool) -> None:
    """Constrained chains run as two graphs around the host's grammar walk (spec/constrained_graphs.py):
    drafts, forced tokens and masks as eagerly, so the output is plain's, forced drafts accepted."""
    eng = _with_graphs(_engine(models, name, overlap=overlap))
    outs = eng.generate(PROMPTS + PROMPTS[:1], GREEDY + [FREE])
    assert [o.output_ids for o in outs] == plain
    assert eng.executor.constrained_graphs.iterations > 0
    assert sum(outs[1].accepted_drafts) >= len(outs[1].output_ids) // 2  # jump-forward drafts, accepted
    _assert_returned(eng)


def test_pd_decode_runs_constrained_graphs_and_equals_colocated(models, plain) -> None:
    binding = bind(_spec(models, "EAGLE"))
    prefill, decode = _engine(models, "EAGLE"), _with_graphs(_engine(models, "EAGLE", overlap=True))
    pd = InProcessPD(prefill, decode, binding)
    try:
        res = pd.run(PROMPTS + PROMPTS[:1], GREEDY + [FREE])
        assert [res.tokens[f"r{i}"] for i in range(len(PROMPTS) + 1)] == plain
        assert decode.executor.constrained_graphs.iterations > 0
        pd.check_returned()
    finally:
        pd.close()


@pytest.mark.parametrize("name", [None, "EAGLE", "EAGLE3"])
def test_overlap_settles_grammars_inside_the_next_launch(models, plain, name: str | None) -> None:
    """With overlap on, a constrained batch is launched before the one in flight is collected:
    the executor collects it (`Batch.settle`) once its forward is enqueued and before it reads a
    matcher, so no step gives up the overlap, and the output is still plain's."""
    eng = _engine(models, name, overlap=True)
    if name is not None:
        _with_graphs(eng)
    outs = eng.generate(PROMPTS + PROMPTS[:1], GREEDY + [FREE])
    assert [o.output_ids for o in outs] == plain
    stats = eng.scheduler.stats
    assert stats["grammar_settles"] > 0 and stats["overlap_syncs"] == 0, stats
    _assert_returned(eng)


def test_an_executor_that_reads_matchers_early_keeps_the_collect_first(models, plain) -> None:
    """n-gram drafts from the host's tokens (no overlap at all); the TP leader's followers need the
    tokens in their plans: executors that do not settle in their launch are never handed a settle."""
    eng = _engine(models, "NGRAM", overlap=True)
    assert not eng.executor.settles_grammar_in_launch()
    assert [o.output_ids for o in eng.generate(PROMPTS + PROMPTS[:1], GREEDY + [FREE])] == plain
    assert eng.scheduler.stats["grammar_settles"] == 0
