"""Verification: accept drafted tokens so the output distribution is exactly the target's.

Drafts here are chosen deterministically (the draft's top-k), so the proposal for a draft
token x is a point mass: accept x with probability p(x) (the target's processed probability),
otherwise remove x from p, renormalise, and try the next sibling; when no child is accepted,
the bonus token is drawn from what is left of p. Trying candidates this way is sampling without
replacement checked against p, so each emitted token is distributed exactly as p, whatever
the draft proposed. It also needs no draft probabilities, which is what lets a decode node
verify drafts a prefill node made. Greedy decoding is the special case where p is one-hot on
the argmax: the draft is accepted iff it equals the argmax, and the bonus is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.noise import uniform_noise
from spec.tree import DraftTree

COIN_STREAM = 2  # noise streams distinct from the plain sampler's (stream 0)
BONUS_STREAM = 3


@dataclass
class VerifyResult:
    accept_lens: torch.Tensor  # (bs,) accepted window rows incl. the root = correct drafts + 1
    path: torch.Tensor  # (bs, max_depth + 1) window rows along the accepted path, -1 padded
    emitted: torch.Tensor  # (bs, max_depth + 1) new tokens: accepted drafts then the bonus, -1 padded
    bonus: torch.Tensor  # (bs,) the new bonus token (root of the next verify)


def verify_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> VerifyResult:
    """target_tokens: (bs, ntok) the target's choice after each window row."""
    if tree.is_chain:
        return _chain_greedy(tree, target_tokens)
    probs = None
    return _walk(tree, lambda cur: torch.gather(target_tokens, 1, cur.unsqueeze(1)).squeeze(1), probs, None, None)


def _chain_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> VerifyResult:
    return chain_greedy(tree.tokens, target_tokens)


def chain_greedy(tokens: torch.Tensor, target_tokens: torch.Tensor) -> VerifyResult:
    """A chain window (bs, ntok; row 0 the bonus) against the target's greedy pick after each
    row, in a handful of whole-window ops (the walk's result, without its per-depth loop: the
    speculative step's host work is mostly op launches; also fixed shapes, so capturable)."""
    bs, ntok = tokens.shape
    j = torch.arange(ntok, device=tokens.device).unsqueeze(0)
    match = tokens[:, 1:] == target_tokens[:, :-1]  # draft j + 1 is the target's pick after row j
    correct = torch.cumprod(match.to(torch.int64), dim=1).sum(1, keepdim=True)  # leading matches
    bonus = torch.gather(target_tokens, 1, correct)
    drafts = torch.cat((tokens[:, 1:], bonus), dim=1)  # emitted row d < correct: draft d + 1
    emitted = torch.where(j < correct, drafts, torch.where(j == correct, bonus, -1))
    path = torch.where(j <= correct, j, -1)
    return VerifyResult(correct.squeeze(1) + 1, path, emitted, bonus.squeeze(1))


def verify_sampled(tree: DraftTree, probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> VerifyResult:
    """probs: (bs, ntok, V) processed target probabilities per window row (one-hot rows = greedy).

    `positions[b]` is the sequence index of the first token this verify can emit; the noise is
    keyed by (seed, position), so a seeded request draws the same randomness in any batch.
    """
    return _walk(tree, None, probs, seeds, positions)


def _walk(
    tree: DraftTree, greedy_pick, probs: torch.Tensor | None, seeds: torch.Tensor | None, positions: torch.Tensor | None
) -> VerifyResult:
    bs, ntok = tree.tokens.shape
    dev = tree.tokens.device
    b_idx = torch.arange(bs, device=dev)
    depth = tree.max_depth
    cur = torch.zeros(bs, dtype=torch.int64, device=dev)
    active = torch.ones(bs, dtype=torch.bool, device=dev)
    path = torch.full((bs, depth + 1), -1, dtype=torch.int64, device=dev)
    emitted = torch.full((bs, depth + 1), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    bonus = torch.full((bs,), -1, dtype=torch.int64, device=dev)
    p_cur = None
    for d in range(depth + 1):
        if probs is None:
            want = greedy_pick(cur)
        else:
            p_cur = probs[b_idx, cur].clone()  # rows that stopped earlier are ignored below
        child = tree.first_child[b_idx, cur] if d < depth else torch.full_like(cur, -1)
        found = torch.full_like(cur, -1)
        coins = uniform_noise(seeds, positions + d, max(ntok, 2), COIN_STREAM) if probs is not None else None
        for k in range(tree.max_children):  # a static bound: no host sync inside the launch
            tok = tree.tokens[b_idx, child.clamp(min=0)]
            live = (child >= 0) & (found < 0)
            if probs is None:
                ok = live & (tok == want)
            else:
                p_tok = p_cur[b_idx, tok]
                ok = live & (coins[:, k] < p_tok)
                # rejected: remove the token from the target distribution and renormalise
                rej = live & ~ok
                p_cur[b_idx, tok] = torch.where(rej, 0.0, p_cur[b_idx, tok])
                p_cur = torch.where(rej.unsqueeze(1), p_cur / p_cur.sum(1, keepdim=True).clamp(min=1e-30), p_cur)
            found = torch.where(ok, child, found)
            child = torch.where(child >= 0, tree.next_sibling[b_idx, child.clamp(min=0)], -1)
        advance = active & (found >= 0)
        stop = active & ~advance
        if probs is None:
            bonus = torch.where(stop, want, bonus)
        else:
            bonus = torch.where(stop, _draw(p_cur, seeds, positions + d), bonus)
        emitted[:, d] = torch.where(stop, bonus, emitted[:, d])
        if d < depth:
            path[:, d + 1] = torch.where(advance, found, -1)
            emitted[:, d] = torch.where(advance, tree.tokens[b_idx, found.clamp(min=0)], emitted[:, d])
            cur = torch.where(advance, found, cur)
        active = advance
    accept_lens = (path >= 0).sum(1)
    return VerifyResult(accept_lens, path, emitted, bonus)


def _draw(p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Exponential-race draw from rows of p with counter-based noise (reproducible per seed)."""
    u = uniform_noise(seeds, positions, p.shape[1], BONUS_STREAM)
    return torch.argmax(p / (-torch.log(u)), dim=1)
