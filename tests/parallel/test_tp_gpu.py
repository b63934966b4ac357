"""Tensor parallelism on two GPUs over NCCL: the all-reduces run inside the captured CUDA graphs
(decode, verify, draft and draft-extend), and graphs equal eager and TP 1, plain and with EAGLE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [8, 1], list(range(100, 121))]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp-gpu")
    target = write_tiny_model(root / "t", seed=1)
    return target, write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat")


def _run(pair: tuple[Path, Path], tp: int, eagle: bool, graphs: bool) -> tuple[list[list[int]], list[list[int]]]:
    from spec.config import SpecConfig
    from spec.registry import bind

    target, head = pair
    cfg = EngineConfig(
        str(target),
        device="cuda:0",
        dtype="float32",
        page_size=4,
        attention_backend="triton",
        overlap=True,
        cuda_graph_max_bs=8 if graphs else 0,
        tp_size=tp,
        tp_timeout_s=60.0,  # a collective that hangs fails the test, with NCCL's watchdog report
    )
    eng = Engine(cfg, algorithm=bind(SpecConfig("EAGLE", str(head), 3, 1, None)) if eagle else None)
    try:
        outs = eng.generate(PROMPTS, GREEDY)
        assert eng.kv.all_free
    finally:
        eng.close()
    return [o.output_ids for o in outs], [o.accepted_drafts for o in outs]


@pytest.mark.parametrize("eagle", [False, True])
def test_tp2_graphs_equal_eager_and_tp1(pair: tuple[Path, Path], eagle: bool) -> None:
    want, _ = _run(pair, 1, eagle=False, graphs=False)
    eager, acc_eager = _run(pair, 2, eagle, graphs=False)
    graphs, acc_graphs = _run(pair, 2, eagle, graphs=True)
    assert eager == want and graphs == want
    assert acc_graphs == acc_eager
