"""Packed allowed-token masks: filled on the host from matchers, applied to logits on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

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
    found = list(_window_rows(matchers, tokens, parents, mask_words(vocab_size)))
    if not found:
        return None
    rows = [b * len(tokens[b]) + r for b, r, _ in found]
    return MaskRows(to_device(rows, device), to_device(torch.stack([w for _, _, w in found]), device))


def window_banned(
    matchers: Sequence[GrammarMatcher | None], tokens: list[list[int]], parents: list[list[int]], vocab_size: int
) -> torch.Tensor:
    """The same masks as `window_masks`, inverted and dense on the host: (bs, ntok, words) int32
    whose set bits are the tokens a row forbids; rows without a mask forbid nothing (all zero),
    so a fixed-shape graph applies the whole window's at once (`ban_tokens`)."""
    W = mask_words(vocab_size)
    banned = torch.zeros((len(tokens), len(tokens[0]) if tokens else 0, W), dtype=torch.int32)
    for b, r, words in _window_rows(matchers, tokens, parents, W):
        banned[b, r] = torch.bitwise_not(words)
    return banned


def _window_rows(
    matchers: Sequence[GrammarMatcher | None], tokens: list[list[int]], parents: list[list[int]], words: int
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(request, row, allowed words) of every window row a matcher constrains."""
    for b, m in enumerate(matchers):
        if m is None:
            continue
        for r in range(len(tokens[b])):
            path = _path(tokens[b], parents[b], r)
            if path is None or m.validate(path) != len(path):
                continue
            row = torch.empty(words, dtype=torch.int32)
            if path:
                m.advance(path)
            m.fill_mask(row)
            m.rollback(len(path))
            yield b, r, row


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
