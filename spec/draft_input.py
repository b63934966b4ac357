"""Draft inputs (what a decode iteration starts from) and the verify input built from a draft tree.

`BonusDraftInput` is the whole state of algorithms that relay nothing but the next input token
(plain decoding, n-gram lookup); `EagleDraftInput` adds the draft's top-k and hidden state.
Both hand the engine their rows as a RelayPayload (PD seeding of FutureMap rows).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.executor import HostCopy, seed_prebuilt_rows
from engine.future_map import RelayPayload
from spec.tree import DraftTree

if TYPE_CHECKING:
    from engine.core import Batch
    from engine.future_map import DraftInput, FutureMap


class DisaggHandoffError(ValueError):
    """A handoff that cannot seed decoding; `rids` names the requests to fail (the rest may go on)."""

    def __init__(self, message: str, rids: list[str]) -> None:
        super().__init__(message)
        self.rids = rids


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0  # no hidden states needed
    LAST = 1  # the last row per request (what the next draft step starts from)
    FULL = 2  # every row (verify: draft-extend needs the whole accepted path)


@dataclass
class EagleReqState:
    """One request's row of a draft input, kept on the request between iterations."""

    topk_p: torch.Tensor  # (topk,) float32: draft probabilities of the token after the bonus
    topk_index: torch.Tensor  # (topk,) int64 target token ids
    hidden: torch.Tensor  # (H,) the draft's output hidden state at the bonus position
    # Set when the three are host copies still in flight (a PD prefill's handoff): wait() first.
    copied: HostCopy | None = None


@dataclass
class EagleDraftInput:
    """Batched draft input: what `draft()` starts from."""

    topk_p: torch.Tensor  # (bs, topk) float32
    topk_index: torch.Tensor  # (bs, topk) int64
    hidden_states: torch.Tensor  # (bs, H)
    bonus_tokens: torch.Tensor  # (bs,) int64, the verify root; no KV yet
    future_indices: torch.Tensor | None = None  # overlap mode: FutureMap rows hold the tensors
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.LAST

    @staticmethod
    def stack(states: list[EagleReqState], bonus_tokens: torch.Tensor) -> "EagleDraftInput":
        return EagleDraftInput(
            torch.stack([s.topk_p for s in states]),
            torch.stack([s.topk_index for s in states]),
            torch.stack([s.hidden for s in states]),
            bonus_tokens,
        )

    def row(self, i: int) -> EagleReqState:
        return EagleReqState(self.topk_p[i], self.topk_index[i], self.hidden_states[i])

    def relay_payload(self) -> RelayPayload:
        return RelayPayload(self.bonus_tokens, self.topk_p, self.topk_index, self.hidden_states)

    def __len__(self) -> int:
        return int(self.bonus_tokens.shape[0])


@dataclass
class BonusDraftInput:
    """The next input token per request and nothing else (plain decoding, drafts from history)."""

    bonus_tokens: torch.Tensor  # (bs,) int64, the next input (the verify root); no KV yet
    future_indices: torch.Tensor | None = None  # FutureMap rows seeded with the bonus tokens

    def relay_payload(self) -> RelayPayload:
        return RelayPayload(self.bonus_tokens)

    def __len__(self) -> int:
        return int(self.bonus_tokens.shape[0])


def check_prebuilt(batch: "Batch", last_tokens: Any, label: str) -> torch.Tensor:
    """The bonus tokens of a PREBUILT batch as int64, validated before anything is touched."""
    if not batch.reqs:
        raise DisaggHandoffError(f"{label}: empty PREBUILT batch (no requests to build a draft input for)", [])
    try:
        bonus = torch.as_tensor(last_tokens).to(torch.int64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise DisaggHandoffError(
            f"{label}: last_tokens must be integer token ids, got {type(last_tokens).__name__}: {e}",
            [r.rid for r in batch.reqs],
        ) from None
    if bonus.dim() != 1 or bonus.shape[0] != len(batch.reqs):
        raise DisaggHandoffError(
            f"{label}: last_tokens has shape {tuple(bonus.shape)}, expected one "
            f"bonus token per request ({len(batch.reqs)})",
            [r.rid for r in batch.reqs],
        )
    if bool((bonus < 0).any()):
        raise DisaggHandoffError(
            f"{label}: last_tokens holds negative token ids {bonus.tolist()}", [r.rid for r in batch.reqs]
        )
    return bonus


def seed_prebuilt(batch: "Batch", future_map: "FutureMap", draft_input: "DraftInput") -> torch.Tensor:
    """`build_disagg_draft_input`'s `future_map` argument: seed the batch's rows from the draft
    input as adopting the requests does (engine.executor.seed_prebuilt_rows, the one way a
    prebuilt request is seeded); returns the rows' indices."""
    return seed_prebuilt_rows(batch.reqs, draft_input, future_map.batch([r.slot for r in batch.reqs]))


def bonus_draft_input(batch: "Batch", last_tokens: Any, future_map: "FutureMap | None", label: str) -> BonusDraftInput:
    """The draft input of algorithms whose decode needs only the bonus token (the drafts, if
    any, come from the context the decode node already has)."""
    bonus = check_prebuilt(batch, last_tokens, label)
    for r in batch.reqs:
        r.spec_state = None  # nothing is kept per request between steps
    if future_map is None:
        return BonusDraftInput(bonus)
    di = BonusDraftInput(bonus.to(future_map.device))
    di.future_indices = seed_prebuilt(batch, future_map, di)
    return di


@dataclass
class EagleVerifyInput:
    """The target's TARGET_VERIFY window: tokens in tree order at depth positions."""

    tree: DraftTree
    positions: torch.Tensor  # (bs * ntok,) seq_len + depth
    tree_mask: torch.Tensor | None  # (bs, ntok, ntok) or None for a chain
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.FULL

    @staticmethod
    def from_tree(tree: DraftTree, seq_lens: torch.Tensor) -> "EagleVerifyInput":
        positions = (seq_lens.unsqueeze(1) + tree.depth).flatten()
        return EagleVerifyInput(tree, positions, tree.attention_mask())
