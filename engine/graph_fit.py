"""Which captured graph a forward fits, from CPU-side facts: fixed-width graphs' checks and every graph's key."""

from __future__ import annotations

from typing import Any

import torch

from engine.core import ForwardMode
from engine.forward_context import ForwardContext
from engine.graph_buffers import GraphKey, input_signature

# modes whose every request has the same query width, so one padded batch size fits them
GRAPH_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


def fixed_unfit(
    input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, Any], max_bs: int, capturing: bool
) -> str | None:
    """Why this forward cannot use a fixed-width graph (None when it can), device aside."""
    if ctx.mode not in GRAPH_MODES:
        return f"mode {ctx.mode.name}"
    lens = ctx.extend_lens_cpu
    if not lens or len(lens) != ctx.batch_size or any(n != lens[0] for n in lens):
        return "ragged extend lengths"
    if ctx.batch_size > max_bs:
        return "batch too large"
    n = ctx.num_tokens
    if n != lens[0] * len(lens) or tuple(input_ids.shape) != (n,):
        return "token count mismatch"
    tm = ctx.tree_mask
    if tm is not None and (tm.dim() != 3 or tuple(tm.shape[:2]) != (len(lens), lens[0]) or tm.dtype != torch.bool):
        return "unexpected tree mask shape"
    for v in model_inputs.values():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n:
            return "model input is not per-token"
    if not capturing and len(ctx.seq_lens_cpu) != len(lens):  # padded eager hands the live lengths on
        return "no CPU sequence lengths"
    return None


def _targets(ctx: ForwardContext) -> tuple[int, int, int]:
    return (id(ctx.kv_pool), id(ctx.req_to_token), id(ctx.attn_backend))


def fixed_key(ctx: ForwardContext, model_inputs: dict[str, torch.Tensor], padded: int) -> GraphKey:
    """The fixed-width graph of this forward at padded batch size `padded`."""
    return GraphKey(
        ctx.mode,
        ctx.extend_lens_cpu[0],
        padded,
        None if ctx.tree_mask is None else int(ctx.tree_mask.shape[2]),
        tuple(ctx.aux_hidden_layers),
        input_signature(model_inputs),
        _targets(ctx),
    )


def ragged_key(
    mode: ForwardMode,
    tokens: int,
    rows: int,
    aux_hidden_layers: tuple[int, ...],
    model_inputs: dict[str, torch.Tensor],
    ctx: ForwardContext,
    decode_rows: int = 0,
) -> GraphKey:
    """A prompt graph's key at bucket (tokens, rows); `decode_rows` > 0: a mixed graph's."""
    return GraphKey(
        mode,
        tokens,
        rows,
        None,
        tuple(aux_hidden_layers),
        input_signature(model_inputs),
        _targets(ctx),
        ragged=True,
        decode_rows=decode_rows,
    )
