"""A one-token decode step's FutureMap reads and writes inside a body captured whole.

`resolve_decode` gathers each request's length and input token and builds the step's context;
`commit_decode` publishes the new lengths, stashes the new tokens and pushes (feature, token)
into a per-request ring (the draft's backlog under 0-step iterations). On CUDA each is one fused
Triton kernel (engine/layers/relay_kernels.py); the FutureMap and ModelRunner ops below are the
reference, run on the CPU, with fused ops off and in FutureMap debug mode (which re-poisons
consumed rows, something the fused read does not do).
"""

from __future__ import annotations

import torch

from engine.core import ForwardMode
from engine.forward_context import ForwardContext
from engine.future_map import FutureMap, RelayPayload
from engine.layers.dispatch import relay_kernels_for
from engine.model_runner import ModelRunner


def resolve_decode(
    fm: FutureMap, runner: ModelRunner, slots: torch.Tensor, *, aux_hidden_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    """(published lengths, input tokens, DECODE context) of the requests at `slots` (0: padding);
    the caller has waited for the publishes (captured: before the replay)."""
    ops = None if fm.debug else relay_kernels_for(slots)
    if ops is None:
        prefix = fm.resolve_seq_lens(slots, wait=False)
        ids = fm.resolve(slots, wait=False, extras=False).bonus_tokens
        ctx = runner.window_context(ForwardMode.DECODE, slots, prefix, 1, aux_hidden_layers=aux_hidden_layers)
        return prefix, ids, ctx
    runner.check_mode(ForwardMode.DECODE)
    prefix, ids, positions, loc, seq_lens, ok = ops.resolve_decode(
        slots, fm.new_seq_lens_buf, fm.output_tokens_buf, runner.kv.req_to_token, runner.max_position
    )
    fm.check_resolved(ok, "new_seq_lens or output_tokens")
    ctx = runner.device_context(
        ForwardMode.DECODE, slots, positions, loc, seq_lens, 1, aux_hidden_layers=aux_hidden_layers
    )
    return prefix, ids, ctx


def commit_decode(
    fm: FutureMap,
    slots: torch.Tensor,
    prefix: torch.Tensor,
    tokens: torch.Tensor,
    ring_tokens: torch.Tensor,
    ring_feats: torch.Tensor,
    sources: list[torch.Tensor],
) -> None:
    """Lengths prefix + 1 published (not recorded: the caller records after the replay), `tokens`
    stashed as the next inputs (the rows keep their top-k and hidden state), and per request the
    features (`sources` side by side) and token pushed into its ring at prefix mod depth."""
    ops = relay_kernels_for(slots)
    if ops is not None:
        ops.commit_decode(
            slots, prefix, tokens, fm.new_seq_lens_buf, fm.output_tokens_buf, ring_tokens, ring_feats, sources
        )
        return
    real = slots != 0
    fm.publish(slots, torch.where(real, prefix + 1, 0), record=False)
    at = prefix % ring_tokens.shape[1]
    feats = sources[0] if len(sources) == 1 else torch.cat(sources, dim=-1)
    ring_feats[slots, at] = feats.to(ring_feats.dtype)
    ring_tokens[slots, at] = tokens
    fm.stash(slots, RelayPayload(torch.where(real, tokens, 0)), keep_topk=True, keep_hidden=True)


__all__ = ["commit_decode", "resolve_decode"]
