"""Head-sliced page transfers between tensor-parallel ranks, checked byte for byte: every
destination rank ends with exactly its KV heads of the source's pages (and a replicated draft
pool whole), whatever the two TP sizes, by replaying the descriptors as memory copies."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from common.tp_layout import TpLayout
from engine.kv_cache import KVPool
from engine.kv_transfer.base import TransferError
from engine.kv_transfer.tp import pool_shapes
from engine.kv_transfer.tp_slices import PoolShape, owned_heads, pair_rows

LAYERS, PAGES, PAGE_SIZE, HEAD_DIM = 2, 9, 4, 8
HEADS, KV_HEADS, DRAFT_KV_HEADS = 6, 2, 1


def _ranks(tp: int, fill: torch.Tensor | None, draft: torch.Tensor | None) -> list[list[KVPool]]:
    """Each rank's [target slice, draft copy] pools, filled from the full tensors (or zero)."""
    ranks = []
    for r in range(tp):
        heads = TpLayout(r, tp, HEADS, KV_HEADS, 12, 60).kv_heads
        target = KVPool(LAYERS, PAGES, PAGE_SIZE, len(heads), HEAD_DIM, torch.float32, "cpu")
        drafts = KVPool(1, PAGES, PAGE_SIZE, DRAFT_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
        if fill is not None and draft is not None:
            target.buffer.copy_(fill[..., heads.start : heads.stop, :])
            drafts.buffer.copy_(draft)
        ranks.append([target, drafts])
    return ranks


def _shapes(tp: int, pools: list[list[KVPool]]) -> list[list[PoolShape]]:
    return [pool_shapes(p, TpLayout(r, tp, HEADS, KV_HEADS, 12, 60).kv_heads) for r, p in enumerate(pools)]


def _copy(local: np.ndarray, remote: np.ndarray) -> None:
    assert local.shape == remote.shape and (local[:, 1] == remote[:, 1]).all()
    for (src, n, _), (dst, _, _) in zip(local.tolist(), remote.tolist()):
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1), (3, 2), (2, 3), (3, 3)])
def test_every_rank_gets_exactly_its_heads(p: int, d: int) -> None:
    gen = torch.Generator().manual_seed(p * 10 + d)
    full = torch.randn(LAYERS, 2, PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    draft = torch.randn(1, 2, PAGES, PAGE_SIZE, DRAFT_KV_HEADS, HEAD_DIM, generator=gen)
    src_pools, dst_pools = _ranks(p, full, draft), _ranks(d, None, None)
    src, dst = _shapes(p, src_pools), _shapes(d, dst_pools)
    src_pages, dst_pages = [1, 2, 3, 7], [4, 5, 8, 2]  # a run that coalesces, then scattered pages
    for i, j in itertools.product(range(p), range(d)):
        _copy(*pair_rows(i, src, dst[j], src_pages, dst_pages))
    for j, (target, drafts) in enumerate(dst_pools):
        heads = TpLayout(j, d, HEADS, KV_HEADS, 12, 60).kv_heads
        for s, t in zip(src_pages, dst_pages):
            assert torch.equal(target.buffer[:, :, t], full[:, :, s, :, heads.start : heads.stop])
            assert torch.equal(drafts.buffer[:, :, t], draft[:, :, s])
        untouched = [q for q in range(PAGES) if q not in dst_pages]
        assert not target.buffer[:, :, untouched].any() and not drafts.buffer[:, :, untouched].any()


def test_a_head_held_by_several_ranks_is_sent_once() -> None:
    shapes = [
        PoolShape((), range(0, 1), 8, 4, True),
        PoolShape((), range(0, 2), 8, 4, True),
        PoolShape((), range(1, 2), 8, 4, True),
    ]
    assert [owned_heads(r, shapes) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 2)]


def test_descriptions_from_a_peer_are_checked() -> None:
    good = PoolShape(pool_shapes(_ranks(1, None, None)[0], range(2))[0].regions, range(2), 32, 4, True).to_json()
    assert PoolShape.from_json(good).heads == range(2)
    for bad in ({**good, "heads": [0, 1]}, {**good, "regions": "x"}, {k: v for k, v in good.items() if k != "sharded"}):
        with pytest.raises(TransferError):
            PoolShape.from_json(bad)


class _Local:
    """Just enough of a transport for TpTransport's handshake checks."""

    name = "local"

    def metadata(self) -> bytes:
        return b"md"

    def load_agent(self, metadata: bytes, layout: object = None, *, connect: bool = True) -> str:
        return "peer"

    def add_peer(self, metadata: bytes, layout: object, *, connect: bool = True) -> str:
        return "peer"


def test_pairs_that_cannot_map_head_for_head_are_refused_by_name() -> None:
    from engine.kv_transfer.tp import TpTransport

    pools = _ranks(1, None, None)[0]
    mine = TpTransport(_Local(), pool_shapes(pools, range(KV_HEADS)))
    fewer = TpTransport(_Local(), pool_shapes(pools[:1], range(KV_HEADS)))
    with pytest.raises(TransferError, match="KV pools"):
        mine.add_peer(fewer.metadata(), None)  # type: ignore[arg-type]
    other = KVPool(LAYERS, PAGES, PAGE_SIZE, 1, HEAD_DIM, torch.float32, "cpu")
    half = TpTransport(_Local(), pool_shapes([other, pools[1]], range(1)))
    with pytest.raises(TransferError, match="holds heads"):
        mine.add_peer(half.metadata(), None)  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="not a pdserve PD node"):
        mine.add_peer(b"plain nixl metadata", None)  # type: ignore[arg-type]
    assert mine.add_peer(TpTransport(_Local(), pool_shapes(pools, range(KV_HEADS))).metadata(), None) == "peer"  # type: ignore[arg-type]
