"""EAGLE's state between iterations (draft input) and the verify input built from a draft tree."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from spec.tree import DraftTree


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
        return EagleDraftInput(torch.stack([s.topk_p for s in states]),
                               torch.stack([s.topk_index for s in states]),
                               torch.stack([s.hidden for s in states]), bonus_tokens)

    def row(self, i: int) -> EagleReqState:
        return EagleReqState(self.topk_p[i], self.topk_index[i], self.hidden_states[i])

    def __len__(self) -> int:
        return int(self.bonus_tokens.shape[0])


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
