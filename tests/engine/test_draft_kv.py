"""A draft head's cache-only pass (`write_kv`) writes exactly the K/V its full forward writes, and
nothing else: what lets the draft's catch-up skip attention and MLP for all but its newest rows."""

from __future__ import annotations

import pytest
import torch

from engine.core import ForwardMode, Req, SamplingParams
from engine.draft_loader import load_draft_model
from engine.engine import Engine, EngineConfig
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from fixtures.tiny_eagle import write_tiny_eagle_head


@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_write_kv_equals_the_cache_entries_of_a_full_forward(tiny_llama_dir, tmp_path, fmt: str) -> None:
    eng = Engine(EngineConfig(str(tiny_llama_dir), page_size=4, max_total_tokens=1024, max_running=8))
    parts = eng.parts
    head_dir = write_tiny_eagle_head(tmp_path / "head", tiny_llama_dir, fmt)
    head, hcfg, _ = load_draft_model(head_dir, fmt, parts.runner.model, parts.model_config, parts.dtype, parts.device)
    pools = [
        KVPool(
            hcfg.num_layers,
            parts.kv.allocator.num_pages,
            parts.kv.page_size,
            hcfg.num_kv_heads,
            hcfg.head_dim,
            parts.dtype,
            parts.device,
        )
        for _ in range(2)
    ]
    runners = [ModelRunner(head, parts.kv, pool, parts.runner.attn_backend, parts.device) for pool in pools]
    reqs = []
    for i, n in enumerate((9, 14)):
        req = Req(f"r{i}", [1] * n, SamplingParams(max_new_tokens=1))
        parts.kv.assign_slot(req)
        parts.kv.reserve(req, n + 8)
        reqs.append(req)
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([r.slot for r in reqs])
    prefix, width = torch.tensor([3, 7]), 6
    writes = torch.ones(2, width, dtype=torch.bool)
    writes[0, 4:] = False  # rows outside a backlog write nothing, in either pass
    ids = torch.randint(0, parts.model_config.vocab_size, (2 * width,), generator=gen)
    feats = torch.randn(2 * width, head.feature_size_from_target, generator=gen)
    with torch.inference_mode():
        full, cache_only = (
            r.window_context(ForwardMode.DRAFT_EXTEND, slots, prefix, width, writes=writes.reshape(-1)) for r in runners
        )
        runners[0].forward_direct(ids, full, features=feats)
        head.write_kv(ids, cache_only, features=feats)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    assert bool(pools[1].buffer.any())
