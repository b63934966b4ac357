"""Chained page hashes: known values, whole pages only, each page's hash depending on everything before it."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from common.prefix_hash import ROOT, block_hash, chain_hashes


def _reference(parent: int, tokens: list[int]) -> int:
    """The documented recipe, spelled out."""
    data = parent.to_bytes(8, "little", signed=True) + struct.pack(f"<{len(tokens)}I", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def test_known_values():
    # Pinned: a change here breaks every router and node of another version (their hashes disagree).
    assert block_hash(ROOT, [1, 2, 3, 4]) == 658132497017838498
    assert chain_hashes(list(range(1, 9)), 4) == [658132497017838498, 7641984106258271874]
    assert chain_hashes(list(range(1, 9)), 4)[1] == _reference(658132497017838498, [5, 6, 7, 8])


def test_whole_pages_only_and_chained():
    ids = list(range(100, 111))  # two whole pages of 4 and a partial one
    h = chain_hashes(ids, 4)
    assert len(h) == 2 and chain_hashes(ids[:3], 4) == [] and chain_hashes([], 4) == []
    assert h == [block_hash(ROOT, ids[:4]), block_hash(h[0], ids[4:8])]
    # the second page alone, or after another first page, is another block
    assert chain_hashes(ids[4:8], 4) != [h[1]]
    assert chain_hashes([0] + ids[1:8], 4)[1] != h[1]
    assert all(-(2**63) <= x < 2**63 for x in h)  # an int64 on the wire
    assert chain_hashes(ids, 2)[:4] != h  # the page size is part of the identity
    with pytest.raises(ValueError):
        chain_hashes(ids, 0)
    # extending a hashed sequence from its last whole page gives the whole sequence's hashes
    assert chain_hashes(ids[4:], 4, parent=h[0]) == h[1:]


def test_stable_across_processes():
    code = "from common.prefix_hash import chain_hashes; print(chain_hashes(list(range(50_000, 50_032)), 16))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"}
    )
    assert out.stdout.strip() == str(chain_hashes(list(range(50_000, 50_032)), 16))
