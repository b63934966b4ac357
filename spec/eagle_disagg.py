"""EAGLE's PD decode entry: the prefill node's handoff becomes the first draft input.

The prefill node ran the target and the draft over the prompt, so it shipped exactly what a
colocated server holds after prefill: both KV pools, the bonus token, the top-k of the draft's
next prediction and the draft hidden state (decoded by EagleHandoffCodec into `Req.handoff`).
Rebuilding the draft input from those makes the first decode iteration indistinguishable from
colocated serving, so acceptance matches too. Verification needs no draft probabilities
(spec/rejection.py proposes drafts as point masses), which is why only the top-k ids and
probabilities travel, not a distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.core import Batch
from spec.config import SpecConfig
from spec.draft_input import DisaggHandoffError, EagleDraftInput, EagleReqState, check_prebuilt, seed_prebuilt

if TYPE_CHECKING:
    from engine.future_map import FutureMap

__all__ = ["DisaggHandoffError", "build_eagle_disagg_draft_input"]


def build_eagle_disagg_draft_input(
    batch: Batch, config: SpecConfig, last_tokens: Any, future_map: "FutureMap | None"
) -> EagleDraftInput:
    bonus = check_prebuilt(batch, last_tokens, "EAGLE")
    k = config.eagle_topk
    bad = [r.rid for r in batch.reqs if not _complete(r.handoff, k)]
    if bad:
        raise DisaggHandoffError(f"EAGLE handoff lacks the draft hidden state or top-{k} for {bad}", bad)
    hs: list[EagleReqState] = [r.handoff for r in batch.reqs]
    widths = {int(h.hidden.shape[-1]) for h in hs}
    if len(widths) != 1:
        raise DisaggHandoffError(
            f"draft hidden states of different widths {sorted(widths)}", [r.rid for r in batch.reqs]
        )
    dev = future_map.device if future_map is not None else bonus.device
    di = EagleDraftInput(
        topk_p=torch.stack([h.topk_p[:k] for h in hs]).to(dev, torch.float32),
        topk_index=torch.stack([h.topk_index[:k] for h in hs]).to(dev, torch.int64),
        hidden_states=torch.stack([h.hidden.reshape(-1) for h in hs]).to(dev),
        bonus_tokens=bonus.to(dev),
    )
    for req in batch.reqs:
        req.spec_state = None  # between iterations a request keeps nothing but its slot
    if future_map is not None:
        di.future_indices = seed_prebuilt(batch, future_map, di)
    return di


def _complete(h: object, k: int) -> bool:
    return (
        isinstance(h, EagleReqState)
        and h.hidden is not None
        and h.topk_p is not None
        and h.topk_index is not None
        and h.topk_p.numel() >= k
        and h.topk_index.numel() >= k
    )
