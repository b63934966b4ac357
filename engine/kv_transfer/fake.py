"""In-process stand-in for NixlTransport, for unit tests of prefill/decode node logic ONLY.

Agents find each other through a module-level registry keyed by name; `metadata()` is just the
name. `write` copies the pages (byte for byte, region by region, exactly like a NIXL WRITE over
the same layout) and the aux row with torch right away, then queues the completion tag on the
target. `fail_mode` injects the failures node logic must survive. Never used in production paths.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVPool
from engine.kv_transfer.rows import HandoffRows
from engine.kv_transfer.base import KVPoll, MemoryLayout, TransferError, TransferRequest, completion_tag
from engine.kv_transfer.layout import kv_regions, tensor_mem_type

_PREFIX = b"fake-agent:"
_REGISTRY: dict[str, FakeTransport] = {}
_REGISTRY_LOCK = threading.Lock()


@dataclass(eq=False)
class FakeXfer:
    room: int
    peer: str
    state: KVPoll
    error: str | None = None


def _slabs(pools: Sequence[KVPool]) -> list[torch.Tensor]:
    """(pages, page_bytes) uint8 views in kv_regions order, so copies are byte-exact."""
    out = []
    for p in pools:
        for layer in range(p.buffer.shape[0]):
            for kv in (0, 1):
                slab = p.buffer[layer, kv]
                out.append(slab.view(torch.uint8).reshape(slab.shape[0], -1))
    return out


class FakeTransport:
    """KVTransport in one process. `fail_mode`: None, "raise" (write raises TransferError),
    "fail" (write copies nothing, poll says FAILED) or "stall" (copies nothing, stays
    TRANSFERRING: for deadline tests)."""

    def __init__(self, name: str, pools: Sequence[KVPool], aux: HandoffRows) -> None:
        self._name, self._pools, self._aux = name, list(pools), aux
        self._slabs = _slabs(self._pools)
        kinds = {tensor_mem_type(p.buffer) for p in self._pools}
        self._layout = MemoryLayout(
            kv=kv_regions(self._pools),
            aux=aux.region(),
            mem_type=kinds.pop() if len(kinds) == 1 else "DRAM",
            aux_mem_type=tensor_mem_type(aux.tensor),
        )
        self._peers: dict[str, MemoryLayout] = {}
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self.fail_mode: str | None = None
        with _REGISTRY_LOCK:
            if name in _REGISTRY:
                raise ValueError(f"a fake agent named {name!r} already exists")
            _REGISTRY[name] = self

    @property
    def name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        return _PREFIX + self._name.encode()

    def layout(self) -> MemoryLayout:
        return self._layout

    def add_peer(self, metadata: bytes, layout: MemoryLayout, *, connect: bool = True) -> str:
        if not metadata.startswith(_PREFIX):
            raise TransferError("not fake-agent metadata")
        why = self._layout.compatible_with(layout)
        if why is not None:
            raise TransferError(f"peer layout is incompatible with {self._name!r}: {why}")
        name = metadata[len(_PREFIX) :].decode()
        if _lookup(name) is None:
            raise TransferError(f"cannot connect to peer {name!r}: no such fake agent")
        self._peers[name] = layout
        return name

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    def write(self, req: TransferRequest) -> FakeXfer:
        if self._closed:
            raise TransferError(f"transport {self._name!r} is closed")
        if req.peer not in self._peers:
            raise TransferError(f"room {req.room}: unknown peer {req.peer!r}")
        target = _lookup(req.peer)
        if target is None:
            raise TransferError(f"room {req.room} -> {req.peer}: peer disconnected")
        if self.fail_mode == "raise":
            raise TransferError(f"room {req.room} -> {req.peer}: injected failure")
        if self.fail_mode in ("fail", "stall"):
            state = KVPoll.FAILED if self.fail_mode == "fail" else KVPoll.TRANSFERRING
            return FakeXfer(req.room, req.peer, state, "injected failure")
        if len(req.src_pages) != len(req.dst_pages):
            raise TransferError(f"{len(req.src_pages)} source vs {len(req.dst_pages)} destination pages")
        _check("source page", req.src_pages, self._layout.kv[0].count if self._slabs else 0)
        _check("destination page", req.dst_pages, target._layout.kv[0].count if target._slabs else 0)
        if req.src_pages:
            src_idx = torch.tensor(req.src_pages, dtype=torch.int64)
            dst_idx = torch.tensor(req.dst_pages, dtype=torch.int64)
            for s, d in zip(self._slabs, target._slabs):
                d[dst_idx.to(d.device)] = s[src_idx.to(s.device)].to(d.device)
        if req.src_aux_row is None or req.dst_aux_row is None:  # partial: pages only, no notification
            return FakeXfer(req.room, req.peer, KVPoll.SUCCESS)
        _check("source aux row", [req.src_aux_row], self._aux.num_rows)
        _check("destination aux row", [req.dst_aux_row], target._aux.num_rows)
        dst = target._aux.tensor
        dst[req.dst_aux_row] = self._aux.tensor[req.src_aux_row].to(dst.device)
        if dst.is_cuda:  # landed before the notification, as NIXL's are (rows are read on another stream)
            torch.cuda.current_stream(dst.device).synchronize()
        target._deliver(self._name, completion_tag(req.room))
        return FakeXfer(req.room, req.peer, KVPoll.SUCCESS)

    def poll(self, handle: object) -> KVPoll:
        return _xfer(handle).state

    def last_error(self, handle: object) -> str | None:
        return _xfer(handle).error

    def release(self, handle: object) -> None:
        x = _xfer(handle)
        if x.state == KVPoll.TRANSFERRING:
            x.state, x.error = KVPoll.FAILED, "released while in flight"

    def notify(self, peer: str, message: bytes) -> None:
        target = _lookup(peer)
        if target is not None:  # best effort, like NIXL's send_notif to a dead peer
            target._deliver(self._name, bytes(message))

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def close(self) -> None:
        self._closed = True
        self._peers.clear()
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self._name) is self:
                del _REGISTRY[self._name]

    def _deliver(self, sender: str, message: bytes) -> None:
        with self._lock:
            self._inbox.append((sender, message))


def _lookup(name: str) -> FakeTransport | None:
    with _REGISTRY_LOCK:
        return _REGISTRY.get(name)


def _xfer(handle: object) -> FakeXfer:
    if not isinstance(handle, FakeXfer):
        raise TypeError(f"not a FakeTransport handle: {handle!r}")
    return handle


def _check(what: str, items: Sequence[int], count: int) -> None:
    for i in items:
        if not 0 < int(i) < count:
            raise TransferError(f"{what} {i} out of range 1..{count - 1}")
