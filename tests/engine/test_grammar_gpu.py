"""Grammar masks on a CUDA device: the mask op equals the CPU's, and a constrained request beside
unconstrained ones under CUDA graphs gives what the eager path gives (constrained rows run
eagerly: whole-step graphs take only plain-argmax batches)."""

from __future__ import annotations

import json

import pytest
import torch

from common.sampling import Constraint
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from engine.grammar.base import mask_words
from engine.grammar.bitmask import MaskRows, apply_token_mask
from fixtures.tiny_model import write_tiny_model

pytestmark = pytest.mark.gpu
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


def test_mask_op_on_cuda_equals_cpu():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 1000, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (3, mask_words(1000)), dtype=torch.int32, generator=g)
    rows = torch.tensor([0, 4, 8])
    want = apply_token_mask(logits.clone(), MaskRows(rows, words))
    got = apply_token_mask(logits.cuda(), MaskRows(rows.cuda(), words.cuda()))
    assert torch.equal(got.cpu(), want)


def test_constrained_beside_graphed_requests(tmp_path):
    model = write_tiny_model(tmp_path / "t", seed=1)
    prompts = [[5, 17, 42, 7], [300] * 5, [8, 1, 9]]
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.0, constraint=Constraint("json_schema", json.dumps(SCHEMA))),
        SamplingParams(max_new_tokens=12, temperature=0.0),
        SamplingParams(max_new_tokens=12, temperature=0.0, constraint=Constraint("regex", "(yes|no)")),
    ]
    outs = {}
    for graphs in (0, 8):
        eng = Engine(EngineConfig(str(model), device="cuda", page_size=4, cuda_graph_max_bs=graphs, overlap=True))
        outs[graphs] = eng.generate(prompts, params)
        assert eng.kv.all_free
    assert [o.output_ids for o in outs[0]] == [o.output_ids for o in outs[8]]
    assert json.loads(outs[8][0].text)["ok"] in (True, False) and outs[8][2].text in ("yes", "no")
