"""A model runner over a paged pool with fake requests of chosen lengths, for step-level timing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import create_attention_backend
from engine.config import ModelConfig
from engine.core import ForwardMode, Req, SamplingParams
from engine.forward_context import ForwardContext
from engine.kv_cache import KVCacheConfig, KVCacheManager, KVPool
from engine.model_runner import ModelRunner


@dataclass
class Rig:
    runner: ModelRunner
    kv: KVCacheManager
    reqs: list[Req]


def make_rig(
    model: nn.Module,
    cfg: ModelConfig,
    device: torch.device,
    *,
    max_reqs: int,
    max_context: int,
    total_tokens: int,
    page_size: int = 16,
    backend: str = "triton",
) -> Rig:
    pages = -(-total_tokens // page_size) + max_reqs + 2  # + one partial page per request
    kv = KVCacheManager(KVCacheConfig(pages, page_size, max_reqs, max_context), device)
    pool = KVPool(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device)
    runner = ModelRunner(model, kv, pool, create_attention_backend(backend), device)
    return Rig(runner, kv, [])


def fill_requests(rig: Rig, bs: int, context: int) -> list[Req]:
    """`bs` requests owning pages for `context` tokens (K/V contents are whatever the pool holds:
    attention reads them all the same)."""
    for req in rig.reqs:
        rig.kv.release(req)
    rig.reqs = []
    for i in range(bs):
        req = Req(f"r{i}", [1] * context, SamplingParams(max_new_tokens=1))
        rig.kv.assign_slot(req)
        rig.kv.reserve(req, context)
        rig.reqs.append(req)
    return rig.reqs


def step_context(
    rig: Rig, mode: ForwardMode, bs: int, context: int, tokens_per_req: int = 1, tree: bool = False
) -> tuple[torch.Tensor, ForwardContext]:
    """Inputs of one step whose last `tokens_per_req` tokens are new and end at `context`."""
    reqs = fill_requests(rig, bs, context)
    prefix = context - tokens_per_req
    dev = rig.runner.device
    mask = None
    if tree:  # a full binary-ish tree is as costly as any other mask: use "see the root + self"
        mask = torch.eye(tokens_per_req, dtype=torch.bool, device=dev).expand(bs, -1, -1).clone()
        mask[:, :, 0] = True
    ctx = rig.runner.make_context(mode, [r.slot for r in reqs], [prefix] * bs, [tokens_per_req] * bs, tree_mask=mask)
    ids = torch.randint(0, 1000, (bs * tokens_per_req,), device=dev)
    return ids, ctx


def decode_step_fn(rig: Rig, ids: torch.Tensor, ctx: ForwardContext, logits_rows: slice | None = None):
    """One forward + logits + greedy pick, what a decode step costs on the device."""

    def run() -> torch.Tensor:
        out = rig.runner.forward(ids, ctx)
        hidden = out[0] if isinstance(out, tuple) else out
        rows = hidden if logits_rows is None else hidden[logits_rows]
        return rig.runner.logits(rows).argmax(-1)

    return run
