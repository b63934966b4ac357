"""Reference attention in plain torch over the paged cache: the CPU path and the test oracle.

Batched, not per-request: each request's context is gathered through the request table into a
padded (bs, max_kv, kv_heads, dim) block, and a boolean mask encodes causality, padding and the
speculative tree. Quadratic in memory for long prompts, which is fine for a reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register_backend

if TYPE_CHECKING:
    from engine.forward_context import ForwardContext


@dataclass
class _Meta:
    kv_slots: torch.Tensor  # (bs, max_kv) token slots, padded with 0
    q_gather: torch.Tensor  # (bs, max_q) packed query row per padded query (padding -> row 0)
    valid: torch.Tensor  # (bs, max_q) bool: real queries
    q_rows: torch.Tensor  # (num_tokens,) packed row of each real padded query, in `valid` order
    mask: torch.Tensor  # (bs, 1, max_q, max_kv) bool, True = may attend


class TorchAttention(AttentionBackend):
    name = "torch"
    graph_safe = False  # prepare() reads seq_lens_cpu and sizes tensors from it

    def prepare(self, ctx: "ForwardContext") -> None:
        dev = ctx.positions.device
        bs = ctx.batch_size
        max_kv = max(ctx.seq_lens_cpu) if ctx.seq_lens_cpu else 0
        max_q = max(ctx.extend_lens_cpu) if ctx.extend_lens_cpu else 0
        kv_pos = torch.arange(max_kv, device=dev)
        kv_slots = ctx.req_to_token[ctx.req_slots, :max_kv]
        q_off = torch.arange(max_q, device=dev)
        q_valid = q_off.unsqueeze(0) < ctx.extend_lens.unsqueeze(1)  # (bs, max_q)
        q_index = torch.where(q_valid, ctx.qo_indptr[:-1].unsqueeze(1) + q_off, -1)
        prefix = (ctx.seq_lens - ctx.extend_lens).unsqueeze(1)  # (bs, 1)
        q_pos = prefix + q_off  # absolute position of each query
        mask = kv_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)  # causal, also hides padding keys
        if ctx.tree_mask is not None:
            # the tree covers each request's last W keys; inside that window the ancestor
            # relation replaces causality (tree nodes sit in slot order, not depth order)
            width = ctx.tree_mask.shape[-1]
            start = (ctx.seq_lens - width).unsqueeze(1)  # (bs, 1)
            in_window = kv_pos.view(1, 1, -1) >= start.unsqueeze(2)
            rel = (kv_pos.view(1, -1) - start).clamp(0, width - 1)  # (bs, max_kv)
            tree = torch.gather(ctx.tree_mask[:, :max_q, :], 2, rel.unsqueeze(1).expand(bs, max_q, max_kv))
            mask = torch.where(in_window, tree, mask)
            mask &= kv_pos.view(1, 1, -1) < ctx.seq_lens.view(-1, 1, 1)  # padding keys of short rows
        # padded query rows keep one visible key so softmax stays finite; their output is dropped
        mask &= q_valid.unsqueeze(2)
        mask[..., 0] |= ~q_valid
        ctx.attn_metadata = _Meta(kv_slots, q_index.clamp(min=0), q_valid, q_index[q_valid], mask.unsqueeze(1))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float, ctx: "ForwardContext"
    ) -> torch.Tensor:
        pool = ctx.kv_pool
        self.store(k, v, layer_id, ctx)
        meta: _Meta = ctx.attn_metadata
        keys = pool.k(layer_id)[meta.kv_slots].to(q.dtype)  # (bs, max_kv, kvh, d)
        vals = pool.v(layer_id)[meta.kv_slots].to(q.dtype)
        qp = q[meta.q_gather]  # (bs, max_q, h, d)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            keys.transpose(1, 2),
            vals.transpose(1, 2),
            attn_mask=meta.mask,
            scale=scale,
            enable_gqa=True,
        )  # (bs, h, max_q, d)
        result = torch.empty_like(q)
        result[meta.q_rows] = out.transpose(1, 2)[meta.valid]
        return result


register_backend("torch", TorchAttention)
