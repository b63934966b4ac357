"""EAGLE's PD decode entry: the prefill node's handoff becomes the first draft input.

The prefill node ran the target and the draft over the prompt, so it shipped exactly what a
colocated server holds after prefill: both KV pools, the bonus token, the top-k of the draft's
next prediction and the draft hidden state. Rebuilding the draft input from those makes the
first decode iteration indistinguishable from colocated serving, so acceptance matches too.
Verification needs no draft probabilities (spec/verify.py proposes drafts as point masses),
which is why only the top-k ids and probabilities travel, not a distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core import Batch
from spec.config import SpecConfig
from spec.draft_input import EagleDraftInput

if TYPE_CHECKING:
    from spec.future_map import FutureMap


class DisaggHandoffError(ValueError):
    """A handoff that cannot seed decoding; `rids` names the requests to fail (the rest may go on)."""

    def __init__(self, message: str, rids: list[str]) -> None:
        super().__init__(message)
        self.rids = rids


def build_eagle_disagg_draft_input(batch: Batch, config: SpecConfig, last_tokens: torch.Tensor,
                                   future_map: "FutureMap | None") -> EagleDraftInput:
    if not batch.reqs:
        raise DisaggHandoffError("empty PREBUILT batch: no request to build an EAGLE draft input for", [])
    k = config.eagle_topk
    bad = [r.rid for r in batch.reqs if not _complete(r.handoff, k)]
    if bad:
        raise DisaggHandoffError(f"EAGLE handoff lacks the draft hidden state or top-{k} for {bad}", bad)
    dev = last_tokens.device
    hs = [r.handoff for r in batch.reqs]
    widths = {int(h.hidden.shape[-1]) for h in hs}
    if len(widths) != 1:
        raise DisaggHandoffError(f"draft hidden states of different widths {sorted(widths)}",
                                 [r.rid for r in batch.reqs])
    di = EagleDraftInput(
        topk_p=torch.stack([torch.as_tensor(h.topk_p)[:k] for h in hs]).to(dev, torch.float32),
        topk_index=torch.stack([torch.as_tensor(h.topk_index)[:k] for h in hs]).to(dev, torch.int64),
        hidden_states=torch.stack([torch.as_tensor(h.hidden) for h in hs]).to(dev),
        bonus_tokens=last_tokens.to(dev, torch.int64))
    if future_map is None:  # no relay: the state stays on the requests (tests, PD prefill)
        for i, req in enumerate(batch.reqs):
            req.spec_state = di.row(i)
    else:  # the worker resolves it from the rows; requests keep nothing but their slot
        from spec.future_map import RelayPayload, seed_rows

        di.future_indices = torch.tensor([r.slot for r in batch.reqs], dtype=torch.int64, device=dev)
        seq_lens = torch.tensor([r.seq_len for r in batch.reqs], dtype=torch.int64, device=dev)
        seed_rows(future_map, di.future_indices, seq_lens, RelayPayload.from_draft_input(di))
    return di


def _complete(h: object, k: int) -> bool:
    return (h is not None and getattr(h, "hidden", None) is not None
            and getattr(h, "topk_p", None) is not None and getattr(h, "topk_index", None) is not None
            and len(h.topk_p) >= k and len(h.topk_index) >= k)  # type: ignore[attr-defined]
