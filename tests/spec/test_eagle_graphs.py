"""EAGLE graphs captured at start-up cover every forward of the decode loop (CPU: the padded
static-buffer path of engine/cuda_graph.py, run eagerly), with widths from the algorithm's hook:
a chain's whole iteration is one graph (spec/eagle_iteration.py), a tree's forwards one each."""

from __future__ import annotations

import pytest

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from spec.config import SpecConfig
from spec.registry import bind

PROMPTS = [[5, 17, 42, 7], [300] * 5, list(range(100, 121))]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("topk,ntok", [(1, None), (2, 5)])
def test_precaptured_graphs_serve_every_decode_forward(pair, topk, ntok) -> None:
    target, head = pair
    spec = SpecConfig("EAGLE", str(head), 3, topk, ntok)
    want = [
        o.output_ids
        for o in Engine(EngineConfig(str(target), page_size=4), algorithm=bind(spec)).generate(PROMPTS, GREEDY)
    ]
    eng = Engine(EngineConfig(str(target), page_size=4), algorithm=bind(spec))
    worker = eng.executor
    worker.target.enable_cuda_graphs(4, capture=False)
    worker.draft.enable_cuda_graphs(4, capture=False)
    worker.capture_cuda_graphs()
    captured = (worker.target.graph_stats.captures, worker.draft.graph_stats.captures)
    assert [o.output_ids for o in eng.generate(PROMPTS, GREEDY)] == want
    # nothing new was needed: verify, draft steps and draft-extend all hit pre-captured graphs
    assert (worker.target.graph_stats.captures, worker.draft.graph_stats.captures) == captured
    if topk == 1:  # whole iterations, one graph each
        assert worker.iteration_graphs is not None and worker.iteration_graphs.hits > 0
    else:
        assert worker.target.graph_stats.hits > 0 and worker.draft.graph_stats.hits > 0
