"""Draft trees: the verify window's tokens, parents, depths and masks, for chain and tree drafts.

A window has `ntok` rows per request: row 0 is the bonus token (the root, no KV yet), rows
1.. are drafted tokens in an order where every parent precedes its children. A chain
(topk = 1) is the tree whose row i has parent i - 1.
"""

from __future__ import annotations

import torch


class DraftTree:
    """A verify window's tokens and structure. A chain's structure follows from its row order, so
    it is built only when something reads it (a captured greedy chain iteration never does)."""

    def __init__(
        self,
        tokens: torch.Tensor,  # (bs, ntok) int64, row 0 = bonus token
        parents: torch.Tensor | None = None,  # (bs, ntok) int64, -1 for the root
        depth: torch.Tensor | None = None,  # (bs, ntok) int64, root 0
        first_child: torch.Tensor | None = None,  # (bs, ntok) int64, -1 none; best draft first
        next_sibling: torch.Tensor | None = None,  # (bs, ntok) int64, -1 none
        is_chain: bool = False,
        # Static bounds known from how the tree was drafted (never read back from the device, so
        # verification launches without a host sync): deepest level and most children of a node.
        depth_bound: int = -1,  # -1: ntok - 1
        branching: int = -1,  # -1: ntok - 1 (1 for a chain)
    ) -> None:
        given = (parents, depth, first_child, next_sibling)
        if not is_chain and any(t is None for t in given):
            raise ValueError("a tree that is not a chain needs parents, depth, first_child and next_sibling")
        self.tokens, self.is_chain = tokens, is_chain
        self.depth_bound, self.branching = depth_bound, branching
        self._links = given if all(t is not None for t in given) else None

    def _structure(self) -> tuple[torch.Tensor, ...]:
        if self._links is None:  # a chain: row i's parent is row i - 1
            bs, ntok = self.tokens.shape
            idx = torch.arange(ntok, device=self.tokens.device).expand(bs, ntok)
            nxt = torch.where(idx + 1 < ntok, idx + 1, -1)
            self._links = (idx - 1, idx.clone(), nxt, torch.full_like(idx, -1))
        return self._links  # type: ignore[return-value]

    @property
    def parents(self) -> torch.Tensor:
        return self._structure()[0]

    @property
    def depth(self) -> torch.Tensor:
        return self._structure()[1]

    @property
    def first_child(self) -> torch.Tensor:
        return self._structure()[2]

    @property
    def next_sibling(self) -> torch.Tensor:
        return self._structure()[3]

    @property
    def ntok(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def max_depth(self) -> int:
        return self.ntok - 1 if self.depth_bound < 0 else min(self.depth_bound, self.ntok - 1)

    @property
    def max_children(self) -> int:
        if self.is_chain:
            return 1
        return self.ntok - 1 if self.branching < 0 else min(self.branching, self.ntok - 1)

    def attention_mask(self) -> torch.Tensor | None:
        """(bs, ntok, ntok) ancestor-or-self mask; None for a chain (causal suffices)."""
        return None if self.is_chain else ancestor_mask(self.parents)


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    return DraftTree(tokens, is_chain=True)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[b, i, j] = j is i or an ancestor of i. Loops over depth, not over requests."""
    bs, ntok = parents.shape
    dev = parents.device
    mask = torch.eye(ntok, dtype=torch.bool, device=dev).expand(bs, ntok, ntok).clone()
    cur = parents.clone()
    for _ in range(ntok - 1):  # a fixed count: no host sync to test for an early exit
        has = cur >= 0
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), ntok).bool() & has.unsqueeze(2)
        cur = torch.where(has, torch.gather(parents, 1, cur.clamp(min=0)), -1)
    return mask


def tree_from_candidates(
    root: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_depth: torch.Tensor,
    ntok: int,
    depth_bound: int = -1,
    branching: int = -1,
) -> DraftTree:
    """Pick the `ntok - 1` best-scoring candidates (EAGLE-2 style re-ranking) into a window.

    Candidates are listed level by level, each candidate's parent index (-1 = root) pointing
    to an earlier candidate, and a child's score (a product of probabilities) never exceeds its
    parent's; a stable sort on descending score therefore keeps every chosen node's parent.
    """
    bs = root.shape[0]
    dev = root.device
    order = torch.sort(-cand_scores, dim=1, stable=True).indices[:, : ntok - 1]
    chosen = torch.sort(order, dim=1).values  # parents (smaller index) come first
    # map candidate index -> window row (root is row 0)
    row_of = torch.full_like(cand_scores, -1, dtype=torch.int64)
    row_of.scatter_(1, chosen, torch.arange(1, ntok, device=dev).expand(bs, ntok - 1).contiguous())
    par_cand = torch.gather(cand_parents, 1, chosen)
    par_row = torch.where(par_cand < 0, torch.zeros_like(par_cand), torch.gather(row_of, 1, par_cand.clamp(min=0)))
    tokens = torch.cat((root.unsqueeze(1), torch.gather(cand_tokens, 1, chosen)), dim=1)
    parents = torch.cat((torch.full((bs, 1), -1, dtype=torch.int64, device=dev), par_row), dim=1)
    depth = torch.cat((torch.zeros(bs, 1, dtype=torch.int64, device=dev), torch.gather(cand_depth, 1, chosen)), dim=1)
    scores = torch.cat((torch.ones(bs, 1, device=dev), torch.gather(cand_scores, 1, chosen)), dim=1)
    first, sib = child_links(parents, scores)
    return DraftTree(tokens, parents, depth, first, sib, False, depth_bound, branching)


def child_links(parents: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """first_child / next_sibling with siblings in descending score order (best draft tried first)."""
    bs, ntok = parents.shape
    dev = parents.device
    first = torch.full((bs, ntok), -1, dtype=torch.int64, device=dev)
    sib = torch.full((bs, ntok), -1, dtype=torch.int64, device=dev)
    # visit nodes from worst to best score so the best ends up as first_child
    order = torch.sort(scores, dim=1, stable=True).indices
    b_idx = torch.arange(bs, device=dev)
    for k in range(ntok):  # rows without a parent (the root) write their old values back
        node = order[:, k]
        par = parents[b_idx, node]
        ok = par >= 0
        pr = par.clamp(min=0)
        sib[b_idx, node] = torch.where(ok, first[b_idx, pr], sib[b_idx, node])
        first[b_idx, pr] = torch.where(ok, node, first[b_idx, pr])
    return first, sib
