"""EAGLE drafting: the models an iteration drives, and a top-k tree of candidates grown by the head, re-ranked.

Level 0 comes for free from the draft input (the top-k after the bonus token). Each further
step runs the head once over the current frontier (top-k nodes per request), expands each node
into top-k children scored by the product of probabilities along the path, and keeps the k
best children as the next frontier. A chain is the topk = 1 case. Frontier nodes write their
draft KV into scratch slots right after the request's committed KV: the level-l frontier at
slots [L + l*k, L + (l+1)*k); a tree mask lets each node see only its ancestors there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from engine.core import ForwardMode, Req
from engine.forward_context import ForwardContext
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


class DraftHead(Protocol):
    """What drafting asks of an EAGLE head (engine/models/eagle.py): logits over its vocabulary,
    and its token ids as the target's (EAGLE-3 heads draft from a smaller vocabulary)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...


def draft_topk(head: DraftHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k draft probabilities and their target token ids for each row of draft hidden states."""
    probs = torch.softmax(head.compute_logits(hidden).float(), dim=-1)
    p, idx = torch.topk(probs, k, dim=-1)
    return p, head.to_target_ids(idx)


class DraftPicker(Protocol):
    """How a chain's drafts are chosen from the head's output. `positions` are the sequence
    positions of the tokens being proposed; `slots` the requests' rows (device tensors)."""

    def on_admit(self, req: Req) -> None: ...

    def pick(self, head: DraftHead, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(rows,) the next draft token of each row."""

    def guess(
        self, head: DraftHead, hidden: torch.Tensor, k: int, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(p, ids), each (rows, k): the top-k after the bonus token (the next verify's first draft)."""


class HeadPicker:
    """The head's own choice: its greedy token, its top-k."""

    def on_admit(self, req: Req) -> None:
        pass

    def pick(self, head: DraftHead, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return head.to_target_ids(head.compute_logits(hidden).argmax(-1))

    def guess(
        self, head: DraftHead, hidden: torch.Tensor, k: int, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return draft_topk(head, hidden, k)


@dataclass(frozen=True)
class EagleModels:
    """What an EAGLE iteration drives: the target, the draft head over its own KV pool, the picker
    of drafts, and the target layers whose outputs feed the head (EAGLE-3; none: the last hidden
    state). `direct` forwards skip the per-forward graphs (inside a graph captured whole)."""

    target: ModelRunner
    draft: ModelRunner
    picker: DraftPicker
    aux_layers: tuple[int, ...]

    @property
    def head(self) -> DraftHead:
        return cast(DraftHead, self.draft.model)

    def features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """What the head reads from the target: its last hidden state, or (EAGLE-3) the
        concatenated low/mid/high layer outputs."""
        return torch.cat(aux, dim=-1) if self.aux_layers else hidden

    def run_target(self, ids: torch.Tensor, ctx: ForwardContext, direct: bool) -> Any:
        return self.target.forward_direct(ids, ctx) if direct else self.target.forward(ids, ctx)

    def run_draft(self, ids: torch.Tensor, ctx: ForwardContext, feats: torch.Tensor, direct: bool) -> torch.Tensor:
        run = self.draft.forward_direct if direct else self.draft.forward
        return run(ids, ctx, features=feats)


def build_draft_tree(
    models: EagleModels,
    di: EagleDraftInput,
    slots: torch.Tensor,
    seq: torch.Tensor,
    num_steps: int,
    topk: int,
    ntok: int,
    direct: bool,
) -> DraftTree:
    """The verify window drafted from `di` for the requests at `slots` (their FutureMap rows, 0 for
    padding) whose exact committed lengths are `seq` (on the device)."""
    if topk == 1:
        return _draft_chain(models, di, slots, seq, num_steps, ntok, direct)
    bs, k = len(di), topk
    dev = di.bonus_tokens.device
    draft = models.draft
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
        ctx = draft.window_context(
            ForwardMode.DECODE,
            slots,
            seq + (step - 1) * k,
            k,
            positions=(seq + step - 1).repeat_interleave(k),
            tree_mask=anc,
        )
        g = models.run_draft(f_tokens.reshape(-1), ctx, f_feats.reshape(bs * k, -1), direct)
        p, idx = draft_topk(models.head, g, k)
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
    models: EagleModels,
    di: EagleDraftInput,
    slots: torch.Tensor,
    seq: torch.Tensor,
    num_steps: int,
    ntok: int,
    direct: bool,
) -> DraftTree:
    """topk = 1: each step feeds the newest draft and the hidden state that proposed it, and the
    picker's choice is the next draft. No scores, parents or masks: every op here is a launch
    the speculative step pays for on the host (or a kernel in its graph)."""
    tok, feats = di.topk_index[:, 0], di.hidden_states
    tokens = [di.bonus_tokens, tok]
    for step in range(1, num_steps):  # draft `step` (at position seq + step) is fed, one slot back
        ctx = models.draft.window_context(ForwardMode.DECODE, slots, seq + step - 1, 1)
        feats = models.run_draft(tok, ctx, feats, direct)
        tok = models.picker.pick(models.head, feats, slots, seq + step + 1)
        tokens.append(tok)
    return chain_tree(torch.stack(tokens, dim=1)[:, :ntok])
