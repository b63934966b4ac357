"""The out-of-tree STANDALONE plugin (examples/standalone, pip-installed by the test set-up) is found
through its entry point, passes the conformance kit, and its PD output equals colocated output
with equal acceptance; its width, FutureMap and draft mode hooks are the ones the engine runs."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from engine.core import ForwardMode, SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import ENTRY_POINT_GROUP, SpeculativeAlgorithm, bind
from spec.testing import check_algorithm

pytest.importorskip("pdserve_standalone", reason="pip install ./examples/standalone (make test does)")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("standalone")
    target = write_tiny_model(root / "t", seed=1)
    # same weights: every draft is the target's own choice; other seed: a weak, different drafter
    return target, write_tiny_model(root / "same", seed=1), write_tiny_model(root / "other", seed=5, num_layers=1)


def test_discovered_by_its_entry_point() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert eps["STANDALONE"] == "pdserve_standalone.algorithm:StandaloneAlgo"
    algo = SpeculativeAlgorithm.from_name("standalone")
    assert type(algo).__module__ == "pdserve_standalone.algorithm" and algo.is_standalone()


@pytest.mark.parametrize("draft", ["same", "other"])
def test_passes_the_conformance_kit(models, draft) -> None:
    target, same, other = models
    report = check_algorithm(SpecConfig("STANDALONE", str(same if draft == "same" else other), 3), target)
    assert report.checks[-3:] == [
        "PD over the in-process transport",
        "empty batch and missing handoff state",
        "generation up to the context limit",
    ]
    if draft == "same":  # the target's own weights draft well (not perfectly: the draft, one token
        assert report.mean_accept_len > 2.5  # ahead of the target's KV, never reads token 0)


def test_the_engine_runs_the_plugins_hooks(models) -> None:
    target, same, _ = models
    binding = bind(SpecConfig("STANDALONE", str(same), 3))
    eng = Engine(
        EngineConfig(str(target), page_size=4, cuda_graph_max_bs=4, cuda_graph_padded_eager=True), algorithm=binding
    )
    worker = eng.executor
    assert worker.width == 5 and eng.scheduler.policy.kv_tokens_per_decode == 5  # ntok 4 + 1
    fm = eng.scheduler.future_map
    assert fm.need_topk and not fm.need_hidden  # its own relay: top-1, no hidden states
    assert {(m, w) for m, w, _ in eng.executor.target.graph_shapes()} == {(ForwardMode.TARGET_VERIFY, 5)}
    assert {(m, w) for m, w, _ in worker.draft.graph_shapes()} == {
        (ForwardMode.TARGET_VERIFY, 5),
        (ForwardMode.DECODE, 1),
    }
    out = eng.generate([[5, 17, 42, 7, 99, 3, 11, 250]], SamplingParams(max_new_tokens=20, temperature=0))
    plain = Engine(EngineConfig(str(target), page_size=4)).generate(
        [[5, 17, 42, 7, 99, 3, 11, 250]], SamplingParams(max_new_tokens=20, temperature=0)
    )
    assert out[0].output_ids == plain[0].output_ids
    assert worker.draft.graph_stats.hits > 0 and worker.target.graph_stats.hits > 0
