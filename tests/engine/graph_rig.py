"""A target and an EAGLE head over one paged cache, with requests holding pages: what the graph
tests (tests/engine/test_*graph*.py, test_mixed_batches.py) run forwards on."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.core import Req, SamplingParams
from engine.draft_loader import load_draft_model
from engine.engine import Engine, EngineConfig
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner


class Rig:
    def __init__(
        self, model_dir: Path, head_dir: Path, device: str = "cpu", dtype: str | None = None, backend: str = "torch"
    ) -> None:
        self.eng = Engine(
            EngineConfig(
                str(model_dir),
                device=device,
                dtype=dtype,
                page_size=4,
                max_total_tokens=4096,
                max_running=70,
                attention_backend=backend,
            )
        )
        parts = self.eng.parts
        self.target, self.kv, self.dev = parts.runner, parts.kv, parts.device
        head, hcfg, _ = load_draft_model(
            head_dir, "eagle", parts.runner.model, parts.model_config, parts.dtype, parts.device
        )
        pool = KVPool(
            hcfg.num_layers,
            self.kv.allocator.num_pages,
            self.kv.page_size,
            hcfg.num_kv_heads,
            hcfg.head_dim,
            parts.dtype,
            parts.device,
        )
        self.draft = ModelRunner(head, self.kv, pool, parts.runner.attn_backend, parts.device)
        self.hidden = parts.model_config.hidden_size
        self.vocab = parts.model_config.vocab_size
        self.live: list[Req] = []
        gen = torch.Generator().manual_seed(0)
        for p in (self.target.pool, self.draft.pool):  # any finite cache contents will do
            p.buffer.copy_(torch.randn(p.buffer.shape, generator=gen))

    def requests(self, bs: int, window: int) -> list[Req]:
        """`bs` requests of varied lengths, with pages for `window` more tokens each."""
        reqs = []
        for i in range(bs):
            req = Req(f"r{i}", [1] * (5 + 7 * i % 37), SamplingParams(max_new_tokens=1))
            self.kv.assign_slot(req)
            self.kv.reserve(req, len(req.prompt_ids) + window)
            reqs.append(req)
        self.live.extend(reqs)
        return reqs

    def release(self, reqs: list[Req]) -> None:
        for r in list(reqs):
            self.kv.release(r)
            self.live.remove(r)
