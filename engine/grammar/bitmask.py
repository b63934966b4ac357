"""Packed allowed-token masks: filled on the host from matchers, applied to logits on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.grammar.base import GrammarMatcher, mask_words
from engine.h2d import to_device


@dataclass(slots=True)
class MaskRows:
    """Which logits rows a grammar constrains and their packed masks, on the device."""

    rows: torch.Tensor  # (n,) int64 row indices into the logits
    words: torch.Tensor  # (n, W) int32, bit t % 32 of word t // 32: token t allowed


def batch_masks(
    matchers: Sequence[GrammarMatcher | None], vocab_size: int, device: torch.device, rows_per_req: int = 1
) -> MaskRows | None:
    """One mask per constrained request from its matcher's current state, repeated over its
    `rows_per_req` rows; None when no request is constrained (those batches pay nothing)."""
    live = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if not live:
        return None
    words = torch.empty((len(live), mask_words(vocab_size)), dtype=torch.int32)
    for k, (_, m) in enumerate(live):
        m.fill_mask(words[k])
    rows = [i * rows_per_req + j for i, _ in live for j in range(rows_per_req)]
    if rows_per_req > 1:
        words = words.repeat_interleave(rows_per_req, dim=0)
    return MaskRows(to_device(rows, device), to_device(words, device))


def window_masks(
    matchers: Sequence[GrammarMatcher | None],
    tokens: list[list[int]],
    parents: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> MaskRows | None:
    """Masks for every row of a verify window: request b's row r holds `tokens[b][r]`, its parent
    row is `parents[b][r]` (-1 for the root, row 0, whose token the matcher already took). Row r's
    mask is the grammar's state after the tokens on the path from the root to r (the root
    excluded), found by advancing the matcher and rolling it back. Rows under a token the grammar
    refuses get no mask: verification can never accept them (their parent's mask excludes it)."""
    allowed = _allowed_window(len(tokens), len(tokens[0]) if tokens else 0, vocab_size)
    found = _fill_window(matchers, tokens, parents, allowed)
    if not found:
        return None
    rows = [b * len(tokens[b]) + r for b, r in found]
    words = allowed.view(-1, allowed.shape[-1]).index_select(0, torch.tensor(rows))
    return MaskRows(to_device(rows, device), to_device(words, device))


def window_banned(
    matchers: Sequence[GrammarMatcher | None], tokens: list[list[int]], parents: list[list[int]], vocab_size: int
) -> torch.Tensor:
    """The same masks as `window_masks`, inverted and dense on the host: (bs, ntok, words) int32
    whose set bits are the tokens a row forbids; rows without a mask forbid nothing (all zero),
    so a fixed-shape graph applies the whole window's at once (`ban_tokens`)."""
    allowed = _allowed_window(len(tokens), len(tokens[0]) if tokens else 0, vocab_size)
    _fill_window(matchers, tokens, parents, allowed)
    return allowed.bitwise_not_()


def _allowed_window(bs: int, ntok: int, vocab_size: int) -> torch.Tensor:
    """(bs, ntok, words) int32, every token allowed until a matcher fills a row."""
    return torch.full((bs, ntok, mask_words(vocab_size)), -1, dtype=torch.int32)


def _fill_window(
    matchers: Sequence[GrammarMatcher | None], tokens: list[list[int]], parents: list[list[int]], allowed: torch.Tensor
) -> list[tuple[int, int]]:
    """Write the mask of every window row a matcher constrains into `allowed[b, r]` (its own
    memory: matchers write rows in place); returns those (request, row) pairs."""
    found: list[tuple[int, int]] = []
    per_request = allowed.unbind(0)  # views made in one call: indexing per row costs microseconds
    for b, m in enumerate(matchers):
        if m is None:
            continue
        if all(p == r - 1 for r, p in enumerate(parents[b])):
            found += [(b, r) for r in _fill_chain(m, tokens[b], per_request[b].unbind(0))]
            continue
        for r in range(len(tokens[b])):
            path = _path(tokens[b], parents[b], r)
            if path is None or m.validate(path) != len(path):
                continue
            if path:
                m.advance(path)
            m.fill_mask(allowed[b, r])
            m.rollback(len(path))
            found.append((b, r))
    return found


def _fill_chain(m: GrammarMatcher, tokens: list[int], allowed: Sequence[torch.Tensor]) -> list[int]:
    """A chain window (row r's parent is r - 1): one walk down it, a mask per row until a draft
    the grammar refuses (or padding), then one rollback; the rows it filled."""
    m.fill_mask(allowed[0])
    depth = 0
    for t in tokens[1:]:
        if t < 0 or not m.advance([t]):  # a refused token is not consumed
            break
        depth += 1
        m.fill_mask(allowed[depth])
    m.rollback(depth)
    return list(range(depth + 1))


def _path(tokens: list[int], parents: list[int], r: int) -> list[int] | None:
    """Tokens from the root's child down to row r (empty for the root); None for padding rows."""
    out: list[int] = []
    while r > 0:
        if tokens[r] < 0:
            return None
        out.append(tokens[r])
        r = parents[r]
        if r < 0:
            return None
    return out[::-1]


def apply_token_mask(logits: torch.Tensor, masks: MaskRows) -> torch.Tensor:
    """-inf on every token the mask forbids in the rows it covers (in place on float logits).
    Fixed-shape device ops, no host sync; tokens past the mask's words are forbidden."""
    V = logits.shape[1]
    ids = torch.arange(V, device=logits.device)
    words = masks.words.index_select(1, (ids >> 5).clamp_(max=masks.words.shape[1] - 1))
    allowed = ((words >> (ids & 31).to(torch.int32)) & 1).bool() & (ids < masks.words.shape[1] * 32)
    sub = logits.index_select(0, masks.rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, masks.rows, sub)


def ban_tokens(logits: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """-inf where `banned` (rows, words) int32 sets a token's bit, in place on every row: fixed
    shapes, capturable in a CUDA graph. The words must cover the logits' width."""
    ids = torch.arange(logits.shape[1], device=logits.device)
    hit = (banned.index_select(1, ids >> 5) >> (ids & 31).to(torch.int32)) & 1
    return logits.masked_fill_(hit.bool(), float("-inf"))
