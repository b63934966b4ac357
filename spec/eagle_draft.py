"""EAGLE drafting: grow a top-k tree of candidate tokens with the draft head, then re-rank.

Level 0 comes for free from the draft input (the top-k after the bonus token). Each further
step runs the head once over the current frontier (top-k nodes per request), expands each node
into top-k children scored by the product of probabilities along the path, and keeps the k
best children as the next frontier. A chain is the topk = 1 case. Frontier nodes write their
draft KV into scratch slots right after the request's committed KV: the level-l frontier at
slots [L + l*k, L + (l+1)*k); a tree mask lets each node see only its ancestors there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core import ForwardMode, Req
from engine.model_runner import ModelRunner
from spec.draft_input import EagleDraftInput
from spec.tree import DraftTree, chain_tree, tree_from_candidates


@dataclass
class _Candidates:
    tokens: list[torch.Tensor]
    scores: list[torch.Tensor]
    parents: list[torch.Tensor]
    depth: list[torch.Tensor]

    def cat(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.cat(x, dim=1) for x in (self.tokens, self.scores, self.parents, self.depth))


def draft_topk(head: torch.nn.Module, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft probabilities and their target token ids for each row of draft hidden states."""
    probs = torch.softmax(head.compute_logits(hidden).float(), dim=-1)
    p, idx = torch.topk(probs, k, dim=-1)
    return p, head.to_target_ids(idx)


class DraftPicker(Protocol):
    """How a chain's drafts are chosen from the head's output. `positions` are the sequence
    positions of the tokens being proposed; `slots` the requests' rows (device tensors)."""

    def on_admit(self, req: Req) -> None: ...

    def pick(
        self, head: torch.nn.Module, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """(rows,) the next draft token of each row."""

    def guess(
        self, head: torch.nn.Module, hidden: torch.Tensor, k: int, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(p, ids), each (rows, k): the top-k after the bonus token (the next verify's first draft)."""


class HeadPicker:
    """The head's own choice: its greedy token, its top-k."""

    def on_admit(self, req: Req) -> None:
        pass

    def pick(
        self, head: torch.nn.Module, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        return head.to_target_ids(head.compute_logits(hidden).argmax(-1))

    def guess(
        self, head: torch.nn.Module, hidden: torch.Tensor, k: int, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return draft_topk(head, hidden, k)


def build_draft_tree(
    draft: ModelRunner,
    di: EagleDraftInput,
    slots: list[int],
    seq: torch.Tensor,
    seq_bound: list[int],
    num_steps: int,
    topk: int,
    ntok: int,
    picker: DraftPicker | None = None,
) -> DraftTree:
    """`seq`: exact committed lengths on the device; `seq_bound`: the host's upper bound of them
    (equal without overlap), used only to size host-side lists."""
    if topk == 1:
        return _draft_chain(draft, di, slots, seq, seq_bound, num_steps, ntok, picker or HeadPicker())
    bs, k = len(di), topk
    dev = di.bonus_tokens.device
    cands = _Candidates(
        [di.topk_index],
        [di.topk_p],
        [torch.full((bs, k), -1, dtype=torch.int64, device=dev)],
        [torch.ones(bs, k, dtype=torch.int64, device=dev)],
    )
    f_tokens, f_scores = di.topk_index, di.topk_p
    f_feats = di.hidden_states.unsqueeze(1).expand(bs, k, -1)  # the hidden that proposed each node
    f_cand = torch.arange(k, device=dev).expand(bs, k)  # frontier nodes' candidate-list index
    anc = torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k)  # over scratch slots so far
    offset = k
    for step in range(1, num_steps):
        ctx = draft.make_context(
            ForwardMode.DECODE,
            slots,
            [s + (step - 1) * k for s in seq_bound],
            [k] * bs,
            device_prefix=seq + (step - 1) * k,
            positions=(seq + step - 1).repeat_interleave(k),
            tree_mask=anc,
        )
        g = draft.forward(f_tokens.reshape(-1), ctx, features=f_feats.reshape(bs * k, -1))
        p, idx = draft_topk(draft.model, g, k)
        child_scores = (f_scores.unsqueeze(2) * p.view(bs, k, k)).reshape(bs, k * k)
        cands.tokens.append(idx.view(bs, k * k))
        cands.scores.append(child_scores)
        cands.parents.append(f_cand.unsqueeze(2).expand(bs, k, k).reshape(bs, k * k))
        cands.depth.append(torch.full((bs, k * k), step + 1, dtype=torch.int64, device=dev))
        sel = torch.topk(child_scores, k, dim=1).indices  # next frontier: best k children
        parent_j = sel // k
        f_tokens = torch.gather(idx.view(bs, k * k), 1, sel)
        f_scores = torch.gather(child_scores, 1, sel)
        f_feats = torch.gather(g.view(bs, k, -1), 1, parent_j.unsqueeze(2).expand(-1, -1, g.shape[-1]))
        f_cand = offset + sel
        offset += k * k
        # ancestors of a new node: its parent's, plus itself in the new level's slots
        anc = torch.cat(
            (
                torch.gather(anc, 1, parent_j.unsqueeze(2).expand(-1, -1, anc.shape[2])),
                torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k),
            ),
            dim=2,
        )
    tokens, scores, parents, depth = cands.cat()
    return tree_from_candidates(
        di.bonus_tokens, tokens, scores, parents, depth, ntok, depth_bound=num_steps, branching=k
    )


def _draft_chain(
    draft: ModelRunner,
    di: EagleDraftInput,
    slots: list[int],
    seq: torch.Tensor,
    seq_bound: list[int],
    num_steps: int,
    ntok: int,
    picker: DraftPicker,
) -> DraftTree:
    """topk = 1: each step feeds the newest draft and the hidden state that proposed it, and the
    head's greedy pick is the next draft. No scores, parents or masks: every op here is a launch
    the speculative step pays for on the host."""
    tok, feats = di.topk_index[:, 0], di.hidden_states
    tokens = [di.bonus_tokens, tok]
    for step in range(1, num_steps):  # draft `step` (at position seq + step) is fed, one slot back
        ctx = draft.make_context(
            ForwardMode.DECODE,
            slots,
            [s + step - 1 for s in seq_bound],
            [1] * len(slots),
            device_prefix=seq + step - 1,
            positions=seq + step - 1,
        )
        feats = draft.forward(tok, ctx, features=feats)
        tok = picker.pick(draft.model, feats, di.future_indices, seq + step + 1)
        tokens.append(tok)
    return chain_tree(torch.stack(tokens, dim=1)[:, :ntok])
