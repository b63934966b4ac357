"""KV transfer between nodes of any tensor-parallel sizes: every rank writes its own head slices.

A PD node's endpoint is a TpTransport over its leader's agent and, on a tensor-parallel node, its
followers' agents (engine/parallel/transfer_service.py), each registering only its rank's KV. Its
metadata names every rank: agent, pools and the KV heads each holds. A write fans out: each source
rank writes to each destination rank the heads it is the one to send (engine/kv_transfer/tp_slices.py),
and only when all those writes have landed does the leader write the handoff row, tagged, to the
peer's leader: the tag still means "everything landed", and the row comes from one rank. Between
two single-GPU nodes a write is the plain transport's own (one tagged write of pages and row).
"""

from __future__ import annotations

import base64
import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from engine.kv_cache import KVPool
from engine.kv_transfer.base import KVPoll, MemoryLayout, TransferError, TransferRequest, completion_tag
from engine.kv_transfer.layout import kv_regions
from engine.kv_transfer.nixl_handles import aux_desc, check_items
from engine.kv_transfer.tp_slices import PoolShape, pair_rows
from engine.parallel.links import RankLink, RankLinkError

MAGIC = b"pdserve-tp/1\n"


def pool_shapes(pools: Sequence[KVPool], kv_heads: range) -> list[PoolShape]:
    """A rank's pools as peers see them: the target's (first) holds `kv_heads`, every other pool
    (a replicated draft's) all of its own heads."""
    shapes = []
    for i, pool in enumerate(pools):
        heads = kv_heads if i == 0 else range(pool.num_kv_heads)
        hb = pool.head_dim * pool.buffer.element_size()
        shapes.append(PoolShape(kv_regions([pool]), heads, hb, pool.page_size, sharded=i == 0))
    return shapes


@dataclass
class _Rank:
    agent: str
    metadata: bytes
    shapes: list[PoolShape]


@dataclass
class _Peer:
    leader: str  # the peer leader's agent name in our leader's agent (rows, notifications)
    layout: MemoryLayout
    ranks: list[_Rank]
    agents: dict[int, list[str]] = field(default_factory=dict)  # our rank -> peer ranks' names there


@dataclass(eq=False)
class _Write:
    req: TransferRequest
    local: list[Any]
    remote: list[Future[Any]]
    aux: Any = None
    state: KVPoll = KVPoll.TRANSFERRING
    error: str | None = None


class TpTransport:
    """KVTransport over every rank's agent of one node (a single rank: its agent alone)."""

    def __init__(
        self,
        local: Any,
        shapes: list[PoolShape],
        links: Sequence[RankLink] = (),
        plans_sent: Callable[[], int] = lambda: 0,
        kind: str = "nixl",
        options: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.local, self.links, self.plans_sent, self.timeout_s = local, list(links), plans_sent, timeout_s
        self.ranks = [_Rank(local.name, local.metadata(), shapes)]
        answers = [link.ask("transport", kind, f"{local.name}-tp{link.rank}", options or {}) for link in self.links]
        for link, fut in zip(self.links, answers):
            md, shapes_json = fut.result(timeout_s)
            self.ranks.append(_Rank(f"{local.name}-tp{link.rank}", md, [PoolShape.from_json(s) for s in shapes_json]))
        self._peers: dict[str, _Peer] = {}

    # ---- identity / handshake ----
    @property
    def name(self) -> str:
        return str(self.local.name)

    def metadata(self) -> bytes:
        ranks = [
            {"agent": r.agent, "md": base64.b64encode(r.metadata).decode(), "pools": [s.to_json() for s in r.shapes]}
            for r in self.ranks
        ]
        return MAGIC + json.dumps({"ranks": ranks}).encode()

    def layout(self) -> MemoryLayout:
        return self.local.layout()

    def add_peer(self, metadata: bytes, layout: MemoryLayout, *, connect: bool = True) -> str:
        ranks = _parse(metadata)
        _check_pair(self.ranks, ranks)
        if len(self.ranks) == 1 and len(ranks) == 1:  # equal single-GPU nodes: the plain checks too
            leader = self.local.add_peer(ranks[0].metadata, layout, connect=connect)
        else:
            leader = self.local.load_agent(ranks[0].metadata, layout, connect=connect)
        peer = _Peer(leader, layout, ranks)
        if connect:  # the writing side: every rank of ours loads every rank of theirs
            peer.agents[0] = [leader] + [self.local.load_agent(r.metadata, connect=True) for r in ranks[1:]]
            asks = [(link, [link.ask("load", r.metadata, True) for r in ranks]) for link in self.links]
            for link, futs in asks:
                peer.agents[link.rank] = [f.result(self.timeout_s) for f in futs]
        self._peers[leader] = peer
        return str(leader)

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)
        self.local.remove_peer(name)

    # ---- data path ----
    def write(self, req: TransferRequest) -> Any:
        peer = self._peers.get(req.peer)
        if peer is None:
            raise TransferError(f"room {req.room}: unknown peer {req.peer!r}")
        if len(self.ranks) == 1 and len(peer.ranks) == 1:
            return self.local.write(req)  # equal single-GPU nodes: one tagged write, as ever
        if len(req.src_pages) != len(req.dst_pages):
            raise TransferError(
                f"room {req.room}: {len(req.src_pages)} source vs {len(req.dst_pages)} destination pages"
            )
        if not peer.agents:
            raise TransferError(f"room {req.room}: peer {req.peer!r} was loaded to receive, not to be written to")
        shapes = [r.shapes for r in self.ranks]
        w = _Write(req, [], [])
        after = self.plans_sent()
        for i in range(len(self.ranks)):
            for j, dst in enumerate(peer.ranks):
                loc, rem = pair_rows(i, shapes, dst.shapes, req.src_pages, req.dst_pages)
                if not len(loc):
                    continue
                agent = peer.agents[i][j]
                if i == 0:
                    w.local.append(self.local.write_rows(req.room, agent, loc, rem))
                else:
                    link = self.links[i - 1]
                    w.remote.append(link.ask("write", req.room, agent, loc, rem, after, self.timeout_s))
        if req.is_final:
            check_items("destination aux row", [req.dst_aux_row], peer.layout.aux.count)  # type: ignore[list-item]
        return w

    def poll(self, handle: object) -> KVPoll:
        if not isinstance(handle, _Write):
            return self.local.poll(handle)
        w = handle
        if w.state != KVPoll.TRANSFERRING:
            return w.state
        if not self._pages_landed(w):
            return w.state
        if not w.req.is_final:
            w.state = KVPoll.SUCCESS
            return w.state
        if w.aux is None:
            w.aux = self._post_row(w)
            if w.aux is None:
                return w.state
        st = self.local.poll(w.aux)
        if st == KVPoll.FAILED:
            w.state, w.error = KVPoll.FAILED, self.local.last_error(w.aux)
        elif st == KVPoll.SUCCESS:
            w.state = KVPoll.SUCCESS
        return w.state

    def _pages_landed(self, w: _Write) -> bool:
        """Every rank's page writes done (False while any is in flight); a failure fails `w`."""
        for h in w.local:
            st = self.local.poll(h)
            if st == KVPoll.FAILED:
                w.state, w.error = KVPoll.FAILED, self.local.last_error(h)
                return False
            if st != KVPoll.SUCCESS:
                return False
        for fut in w.remote:
            if not fut.done():
                return False
            try:
                fut.result()
            except RankLinkError as e:
                w.state, w.error = KVPoll.FAILED, str(e)
                return False
        return True

    def _post_row(self, w: _Write) -> Any:
        req, peer = w.req, self._peers.get(w.req.peer)
        if peer is None:
            w.state, w.error = KVPoll.FAILED, f"peer {req.peer!r} was removed"
            return None
        me = self.local.layout()
        local = aux_desc(me, req.src_aux_row)  # type: ignore[arg-type]
        remote = aux_desc(peer.layout, req.dst_aux_row)  # type: ignore[arg-type]
        kinds = (me.aux_mem_type, peer.layout.aux_mem_type)
        try:
            return self.local.write_rows(req.room, req.peer, local, remote, completion_tag(req.room), kinds)
        except TransferError as e:
            w.state, w.error = KVPoll.FAILED, str(e)
            return None

    def last_error(self, handle: object) -> str | None:
        return handle.error if isinstance(handle, _Write) else self.local.last_error(handle)

    def release(self, handle: object) -> None:
        if not isinstance(handle, _Write):
            self.local.release(handle)
            return
        for h in [*handle.local, *([handle.aux] if handle.aux is not None else [])]:
            self.local.release(h)
        if handle.state == KVPoll.TRANSFERRING:
            handle.state, handle.error = KVPoll.FAILED, "released while in flight"

    # ---- control messages ----
    def notify(self, peer: str, message: bytes) -> None:
        self.local.notify(peer, message)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        return list(self.local.drain_notifications())

    def close(self) -> None:
        for link in self.links:
            link.ask("close")
        self.local.close()


def _parse(metadata: bytes) -> list[_Rank]:
    """A peer's ranks from its metadata (JSON of plain numbers and base64 agent metadata)."""
    if not bytes(metadata).startswith(MAGIC):
        raise TransferError("the peer is not a pdserve PD node of this version (no rank description)")
    try:
        doc = json.loads(bytes(metadata)[len(MAGIC) :])
        return [
            _Rank(str(r["agent"]), base64.b64decode(r["md"]), [PoolShape.from_json(p) for p in r["pools"]])
            for r in doc["ranks"]
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise TransferError(f"malformed peer rank description: {e}") from None


def _check_pair(mine: list[_Rank], theirs: list[_Rank]) -> None:
    """Refuse, by name, pairs whose KV cannot map head for head."""
    if not theirs:
        raise TransferError("the peer describes no ranks")
    for k in range(len(mine[0].shapes)):
        if len(theirs[0].shapes) != len(mine[0].shapes):
            raise TransferError(f"the peer has {len(theirs[0].shapes)} KV pools, this node {len(mine[0].shapes)}")
        a = [r.shapes[k] for r in mine]
        b = [r.shapes[k] for r in theirs]
        if a[0].sharded and _all_heads(a) != _all_heads(b):
            raise TransferError(f"KV pool {k}: this node holds heads {_all_heads(a)}, the peer {_all_heads(b)}")
        if (a[0].page_size, a[0].head_bytes, len(a[0].regions)) != (b[0].page_size, b[0].head_bytes, len(b[0].regions)):
            raise TransferError(f"KV pool {k}: page size, head size or layer count differ")


def _all_heads(shapes: list[PoolShape]) -> range:
    return range(min(s.heads.start for s in shapes), max(s.heads.stop for s in shapes))


__all__ = ["MAGIC", "TpTransport", "pool_shapes"]
