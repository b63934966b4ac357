"""Jump-forward as a draft source: tokens a request's grammar forces are offered as its drafts."""

from __future__ import annotations

from engine.core import Req
from engine.h2d import to_device
from spec.tree import DraftTree


def forced_drafts(req: Req, k: int) -> list[int]:
    """Up to `k` tokens the grammar allows as the only continuation of `req` (its matcher has
    taken every token so far, the bonus included); [] without a grammar. Offered as drafts they
    are verified like any other, so output stays exact: a forced string the target would split
    into other tokens is simply rejected."""
    matcher = req.live_grammar
    if matcher is None or k <= 0:
        return []
    return matcher.forced_tokens()[:k]


def offer_forced_drafts(reqs: list[Req], tree: DraftTree) -> DraftTree:
    """A chain window whose constrained requests draft their grammar's forced tokens first; the
    algorithm's drafts after them stay (they were drafted for another prefix: usually rejected).
    Trees are left as drafted."""
    if not tree.is_chain:
        return tree
    k = tree.ntok - 1
    rows, cols, vals = [], [], []
    for b, req in enumerate(reqs):
        for j, tok in enumerate(forced_drafts(req, k)):
            rows.append(b)
            cols.append(1 + j)
            vals.append(tok)
    if not rows:
        return tree
    tokens = tree.tokens.clone()
    idx = to_device([rows, cols], tokens.device)
    tokens[idx[0], idx[1]] = to_device(vals, tokens.device)
    return DraftTree(tokens, is_chain=True, depth_bound=tree.depth_bound, branching=tree.branching)


def force_drafts_on_host(reqs: list[Req], tokens: list[list[int]]) -> bool:
    """`offer_forced_drafts` on a chain window already read to the host (rows of `tokens`,
    changed in place); True when any row changed."""
    changed = False
    for req, row in zip(reqs, tokens):
        for j, tok in enumerate(forced_drafts(req, len(row) - 1)):
            changed |= row[1 + j] != tok
            row[1 + j] = tok
    return changed
