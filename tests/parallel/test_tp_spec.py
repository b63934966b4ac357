"""Speculation at TP 2 on CPU over gloo: every algorithm (the plugin too) gives plain decoding's
greedy output and the same acceptance as at TP 1, overlap on and off, with adaptive steps agreeing
on every rank (a disagreement would desynchronise the collectives and hang or fail the step)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121))]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-spec")
    target = write_tiny_model(root / "t", seed=1)  # 4 heads over 2 KV heads: one KV head per rank
    return {
        "target": target,
        "EAGLE": write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat"),
        "EAGLE3": write_tiny_eagle_head(root / "h3", target, "eagle3", draft_vocab_size=300),
        "STANDALONE": write_tiny_model(root / "d", seed=1),
    }


_RUNS: dict[tuple, tuple[list[list[int]], list[list[int]]]] = {}


def _run(models: dict[str, Path], spec: SpecConfig | None, tp: int, **kw) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs and acceptance; each configuration runs once per session (the references
    several tests compare with are shared)."""
    key = (str(models["target"]), repr(spec), tp, tuple(sorted(kw.items())))
    if key not in _RUNS:
        _RUNS[key] = _generate(models, spec, tp, **kw)
    return _RUNS[key]


def _generate(
    models: dict[str, Path], spec: SpecConfig | None, tp: int, **kw
) -> tuple[list[list[int]], list[list[int]]]:
    binding = bind(spec) if spec is not None else None
    eng = Engine(
        EngineConfig(str(models["target"]), page_size=4, max_total_tokens=1024, tp_size=tp, **kw), algorithm=binding
    )
    try:
        outs = eng.generate(PROMPTS, GREEDY)
        assert eng.kv.all_free
    finally:
        eng.close()
    return [o.output_ids for o in outs], [o.accepted_drafts for o in outs]


@pytest.mark.parametrize(
    "algo,overlap,extra",
    [
        ("EAGLE", True, {}),
        ("EAGLE", False, {"num_draft_tokens": 5, "eagle_topk": 2}),
        ("EAGLE3", True, {}),
        ("NGRAM", False, {}),
        ("STANDALONE", True, {}),
        ("EAGLE", True, {"adaptive": True}),
    ],
)
def test_tp2_speculation_equals_plain_output_and_tp1_acceptance(
    models: dict[str, Path], algo: str, overlap: bool, extra: dict
) -> None:
    if algo == "STANDALONE" and importlib.util.find_spec("pdserve_standalone") is None:
        pytest.skip("pip install ./examples/standalone (make test does)")
    plain, _ = _run(models, None, 1)
    spec = SpecConfig(algo) if algo == "NGRAM" else SpecConfig(algo, str(models[algo]), 3, **extra)
    ids1, acc1 = _run(models, spec, 1, overlap=overlap)
    ids2, acc2 = _run(models, spec, 2, overlap=overlap)
    assert ids1 == plain and ids2 == plain
    assert acc2 == acc1
    if algo == "EAGLE":  # its head repeats the target: drafts are accepted, so acceptance is tested
        assert any(a > 0 for accepted in acc2 for a in accepted)


def test_tp2_graph_path_equals_plain(models: dict[str, Path]) -> None:
    """The CUDA-graph code path (padded static buffers, run uncaptured on the CPU) with the
    collectives inside each forward, as the captured graphs hold them on GPUs."""
    plain, _ = _run(models, None, 1)
    spec = SpecConfig("EAGLE", str(models["EAGLE"]), 3)
    graphs = {"cuda_graph_max_bs": 4, "cuda_graph_padded_eager": True, "overlap": True}
    ids1, acc1 = _run(models, spec, 1, **graphs)
    ids2, acc2 = _run(models, spec, 2, **graphs)
    assert ids2 == plain and acc2 == acc1
    plain2, _ = _run(models, None, 2, **graphs)
    assert plain2 == plain


def test_tp3_eagle_on_the_builtin_pair_equals_tp1() -> None:
    """Three ranks: 6 heads over 2 KV heads (the middle rank holds both) and a padded vocabulary
    block, with the built-in trained head drafting (so acceptance is high and varied)."""
    from pdserve.models import BUILTIN_DRAFT, BUILTIN_DRAFT_STEPS, BUILTIN_TARGET

    models = {"target": BUILTIN_TARGET}
    spec = SpecConfig("EAGLE", str(BUILTIN_DRAFT), BUILTIN_DRAFT_STEPS)
    plain, _ = _run(models, None, 1, dtype="float32")
    ids1, acc1 = _run(models, spec, 1, dtype="float32", overlap=True)
    ids3, acc3 = _run(models, spec, 3, dtype="float32", overlap=True)
    assert ids1 == plain and ids3 == plain
    assert acc3 == acc1 and sum(map(sum, acc3)) > 0


def test_tp2_constrained_output_equals_tp1(models: dict[str, Path]) -> None:
    """Every rank masks as the leader does (each follower keeps its own matcher at the tokens its
    mirror of the request holds): constrained EAGLE output, greedy and sampled, overlap on, equals
    TP 1's, and conforms."""
    import json
    import re

    from common.sampling import Constraint

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constraints = [Constraint("regex", "(yes|no|maybe)"), Constraint("json_schema", json.dumps(schema))]
    params = [
        SamplingParams(max_new_tokens=24, temperature=t, seed=3, constraint=c) for c in constraints for t in (0.0, 0.8)
    ]
    spec = SpecConfig("EAGLE", str(models["EAGLE"]), 3)
    outs = {}
    for tp in (1, 2):
        eng = Engine(
            EngineConfig(str(models["target"]), page_size=4, max_total_tokens=1024, tp_size=tp, overlap=True),
            algorithm=bind(spec),
        )
        try:
            outs[tp] = [(o.output_ids, o.text) for o in eng.generate([PROMPTS[0]] * len(params), params)]
        finally:
            eng.close()
    assert outs[2] == outs[1]
    for (_, text), p in zip(outs[2], params):
        assert text is not None
        if p.constraint is not None and p.constraint.kind == "regex":
            assert re.fullmatch("(yes|no|maybe)", text), text
