"""What each tensor-parallel rank of a prefill writes into each rank of a decode: head slices of pages.

A rank's KV pool holds, per (layer, K|V) region, pages of `page_size` tokens x its KV heads x
head_dim. Ranks of different TP sizes hold different head ranges, so a page of one rank maps onto
parts of pages of another: for each token, the heads both hold form one contiguous run on each
side (heads are innermost but one), which is one descriptor of a strided transfer, straight from
pool to pool with no staging copy. Where both ranks hold exactly the same heads the whole page
moves as one descriptor, and runs of consecutive pages coalesce as between equal nodes.

A head that several source ranks hold (KV heads replicated over ranks) is sent by the lowest of
them only. Pools that are not sharded (a draft that runs replicated on every rank) go whole from
source rank 0 to every destination rank, each of which holds a full copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.kv_transfer.base import Region, TransferError
from engine.kv_transfer.layout import coalesce_runs, run_descs


@dataclass(frozen=True)
class PoolShape:
    """One pool of one rank as a peer sees it: its (layer, K|V) regions and which KV heads it holds."""

    regions: tuple[Region, ...]
    heads: range  # global KV head ids held (all of them for a replicated pool)
    head_bytes: int  # one head's head_dim values
    page_size: int
    sharded: bool

    def to_json(self) -> dict[str, object]:
        return {
            "regions": [[r.addr, r.item_bytes, r.count, r.device_id] for r in self.regions],
            "heads": [self.heads.start, self.heads.stop],
            "head_bytes": self.head_bytes,
            "page_size": self.page_size,
            "sharded": self.sharded,
        }

    @staticmethod
    def from_json(d: dict[str, object]) -> "PoolShape":
        """From a peer's handshake: plain numbers only, checked for consistency."""
        try:
            regions = tuple(Region(int(a), int(b), int(c), int(e)) for a, b, c, e in d["regions"])  # type: ignore[attr-defined]
            h0, h1 = (int(x) for x in d["heads"])  # type: ignore[attr-defined]
            shape = PoolShape(regions, range(h0, h1), int(d["head_bytes"]), int(d["page_size"]), bool(d["sharded"]))  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as e:
            raise TransferError(f"malformed tensor-parallel pool description: {e}") from None
        page = shape.page_size * len(shape.heads) * shape.head_bytes
        if not shape.heads or any(r.item_bytes != page for r in regions):
            raise TransferError("tensor-parallel pool description: page size does not match its heads")
        return shape


def owned_heads(rank: int, shapes: Sequence[PoolShape]) -> range:
    """The heads of a sharded pool that `rank` sends: those it holds and no lower rank holds."""
    start = max([shapes[rank].heads.start] + [s.heads.stop for s in shapes[:rank]])
    return range(min(start, shapes[rank].heads.stop), shapes[rank].heads.stop)


def slice_rows(
    src: PoolShape, dst: PoolShape, heads: range, src_pages: Sequence[int], dst_pages: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(local rows, remote rows), N x 3 (addr, len, dev) each, moving `heads` of every page pair."""
    if len(src.regions) != len(dst.regions) or src.page_size != dst.page_size or src.head_bytes != dst.head_bytes:
        raise TransferError("tensor-parallel pools differ in layers, page size or head size")
    if not heads or len(src_pages) == 0:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty
    if heads == src.heads == dst.heads:  # whole pages, runs coalesced
        s0, d0, n = coalesce_runs(src_pages, dst_pages)
        return run_descs(src.regions, s0, n), run_descs(dst.regions, d0, n)
    return _strided(src, heads, src_pages), _strided(dst, heads, dst_pages)


def _strided(shape: PoolShape, heads: range, pages: Sequence[int]) -> np.ndarray:
    """One row per (region, page, token): `heads` of that token, contiguous in the page."""
    hb = shape.head_bytes
    token_bytes = len(shape.heads) * hb
    addr = np.array([r.addr for r in shape.regions], dtype=np.uint64)[:, None, None]
    item = np.array([r.item_bytes for r in shape.regions], dtype=np.uint64)[:, None, None]
    dev = np.array([r.device_id for r in shape.regions], dtype=np.uint64)[:, None, None]
    pg = np.asarray(pages, dtype=np.uint64)[None, :, None]
    tok = np.arange(shape.page_size, dtype=np.uint64)[None, None, :]
    out = np.empty((len(shape.regions), len(pages), shape.page_size, 3), dtype=np.uint64)
    out[..., 0] = addr + pg * item + tok * np.uint64(token_bytes) + np.uint64((heads.start - shape.heads.start) * hb)
    out[..., 1] = np.uint64(len(heads) * hb)
    out[..., 2] = dev
    return out.reshape(-1, 3)


def pair_rows(
    src_rank: int,
    src: Sequence[Sequence[PoolShape]],
    dst: Sequence[PoolShape],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """Everything source rank `src_rank` writes into one destination rank (`dst`: its pools), over
    every pool: `src[rank][pool]` describes every source rank, for who sends a shared head."""
    mine = src[src_rank]
    if len(mine) != len(dst):
        raise TransferError(f"the peer has {len(dst)} KV pools, this node {len(mine)}")
    local, remote = [], []
    for k, (s, d) in enumerate(zip(mine, dst)):
        if s.sharded != d.sharded:
            raise TransferError(f"KV pool {k} is sharded on one side only")
        if s.sharded:
            sends = owned_heads(src_rank, [ranks[k] for ranks in src])
            heads = range(max(sends.start, d.heads.start), min(sends.stop, d.heads.stop))
        else:
            heads = s.heads if src_rank == 0 else range(0)
            if s.heads != d.heads:
                raise TransferError(f"replicated KV pool {k} holds other heads on the peer")
        loc, rem = slice_rows(s, d, heads, src_pages, dst_pages)
        local.append(loc)
        remote.append(rem)
    return np.concatenate(local), np.concatenate(remote)
