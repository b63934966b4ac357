"""Chained KV page hashes: one signed 64-bit id per whole page of a token sequence, the same on every machine.

A page's hash covers its parent's hash and its own token ids, so equal hashes mean equal prefixes
(up to 64-bit collisions): a node publishes the hashes of the pages it caches, and a router that
hashes a request's tokens the same way finds how far that node's cache reaches into the request.
blake2b-64 over the parent hash (8 bytes, little-endian, signed) then the page's token ids
(little-endian uint32); the first page's parent is ROOT. Signed because KvBlock.block_hash is an
int64 on the wire. Python's hash() is salted per process, so it is never used here.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

ROOT = 0  # the parent hash of a sequence's first page


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of one page holding `tokens` whose preceding pages hash to `parent`."""
    return _digest(parent, struct.pack(f"<{len(tokens)}I", *tokens))


def chain_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT) -> list[int]:
    """The hashes of `tokens`' whole pages, in order (a partial last page has none); `parent`: the
    hash of the pages before `tokens` (extending a sequence whose earlier pages are hashed)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    whole = len(tokens) // page_size
    data = struct.pack(f"<{whole * page_size}I", *tokens[: whole * page_size])  # packed once, sliced per page
    step, out = 4 * page_size, []
    for j in range(whole):
        parent = _digest(parent, data[j * step : (j + 1) * step])
        out.append(parent)
    return out


def _digest(parent: int, packed: bytes) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little", signed=True), digest_size=8)
    h.update(packed)
    return int.from_bytes(h.digest(), "little", signed=True)
