"""What STANDALONE carries between iterations and from a prefill node: the draft's top-1 after the
bonus token. Its draft input, the codec of its 16-byte handoff payload, and the PD builder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spec.api import (
    Batch,
    DisaggHandoffError,
    FutureMap,
    HandoffError,
    RelayPayload,
    Req,
    check_prebuilt,
    seed_prebuilt,
)


@dataclass
class DraftGuess:
    """One request's draft prediction after its bonus token."""

    p: torch.Tensor  # (1,) float32
    token: torch.Tensor  # (1,) int64


@dataclass
class StandaloneDraftInput:
    bonus_tokens: torch.Tensor  # (bs,) int64: the verify root, no KV yet
    topk_p: torch.Tensor  # (bs, 1) float32
    topk_index: torch.Tensor  # (bs, 1) int64: the first draft of the next verify

    def relay_payload(self) -> RelayPayload:
        return RelayPayload(self.bonus_tokens, self.topk_p, self.topk_index)

    def __len__(self) -> int:
        return int(self.bonus_tokens.shape[0])


class GuessCodec:
    """Payload: p float32 (+4 pad), token int64."""

    payload_bytes = 16

    def encode(self, req: Req) -> torch.Tensor:
        guess = req.spec_state
        if not isinstance(guess, DraftGuess):
            raise HandoffError(f"request {req.rid} finished prefill without a STANDALONE draft guess")
        out = torch.zeros(16, dtype=torch.uint8)
        out[0:4].view(torch.float32)[0] = float(guess.p.reshape(-1)[0])
        out[8:16].view(torch.int64)[0] = int(guess.token.reshape(-1)[0])
        return out

    def decode(self, payload: torch.Tensor) -> DraftGuess:
        if payload.numel() < 16:
            raise HandoffError(f"STANDALONE handoff payload has {payload.numel()} bytes, needs 16")
        data = payload.reshape(-1)[:16].cpu().clone()
        return DraftGuess(data[0:4].view(torch.float32).clone(), data[8:16].view(torch.int64).clone())


def build_draft_input(batch: Batch, last_tokens: Any, future_map: FutureMap | None, label: str) -> StandaloneDraftInput:
    bonus = check_prebuilt(batch, last_tokens, label)
    missing = [r.rid for r in batch.reqs if not isinstance(r.handoff, DraftGuess)]
    if missing:
        raise DisaggHandoffError(f"{label}: handoff lacks the draft guess for {missing}", missing)
    dev = future_map.device if future_map is not None else bonus.device
    di = StandaloneDraftInput(
        bonus.to(dev),
        torch.stack([r.handoff.p.reshape(1) for r in batch.reqs]).to(dev, torch.float32),
        torch.stack([r.handoff.token.reshape(1) for r in batch.reqs]).to(dev, torch.int64),
    )
    for r in batch.reqs:
        r.spec_state = None
    if future_map is not None:
        seed_prebuilt(batch, future_map, di)
    return di
