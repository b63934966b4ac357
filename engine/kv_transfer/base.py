"""The KV transfer contract between a prefill node (writer) and a decode node (reader's memory).

Decode-driven: the decode node owns the destination memory, reserves pages and an aux row, and
tells the prefill node where to write. The prefill node WRITEs the request's pages of every
registered pool (target and draft share page ids) plus one aux row in a final transfer whose
completion notification carries the room; the decode node commits only after seeing that
notification AND the aux row's room echo equal to its room. Pages whose KV is final before the
prompt ends (chunked prefill) may go ahead in partial writes: pages only, no aux row and no
notification; the writer lets every partial write end before posting the final one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


class KVPoll(enum.IntEnum):
    """Per-request transfer state. Ordered: a stage only moves forward; Failed is sticky."""

    FAILED = 0
    BOOTSTRAPPING = 1  # peer not connected / destination not known yet
    WAITING_FOR_INPUT = 2  # destination known, prefill compute not finished
    TRANSFERRING = 3
    SUCCESS = 4


class TransferError(RuntimeError):
    """A transfer could not be posted or failed in flight; the message says why."""


@dataclass(frozen=True)
class Region:
    """One registered memory region: `count` equal items of `item_bytes` starting at `addr`."""

    addr: int
    item_bytes: int
    count: int
    device_id: int = 0


@dataclass(frozen=True)
class MemoryLayout:
    """What one side registered: KV regions (one per (pool, layer, k|v), items = pages) in a fixed
    order both sides agree on, and the aux region (items = rows). `mem_type` (of the KV regions)
    and `aux_mem_type` are DRAM or VRAM (rows beside the KV by default, in host memory with
    `--kv-handoff-rows host`)."""

    kv: tuple[Region, ...]
    aux: Region
    mem_type: str = "DRAM"
    aux_mem_type: str = "DRAM"

    def compatible_with(self, other: "MemoryLayout") -> str | None:
        """None when pages and rows can be copied item for item; else what differs."""
        if len(self.kv) != len(other.kv):
            return f"number of KV regions differs ({len(self.kv)} vs {len(other.kv)})"
        for i, (a, b) in enumerate(zip(self.kv, other.kv)):
            if a.item_bytes != b.item_bytes:
                return f"KV region {i} page size in bytes differs ({a.item_bytes} vs {b.item_bytes})"
        if self.aux.item_bytes != other.aux.item_bytes:
            return f"aux row size differs ({self.aux.item_bytes} vs {other.aux.item_bytes})"
        return None


@dataclass
class TransferRequest:
    """One write: source pages/aux row here, destination pages/aux row at the peer. Without aux
    rows it is a partial write (pages only, the peer is not notified)."""

    room: int
    peer: str
    src_pages: list[int]
    dst_pages: list[int]
    src_aux_row: int | None
    dst_aux_row: int | None
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def is_final(self) -> bool:
        """The write that carries the aux row and notifies the peer with the room."""
        return self.src_aux_row is not None and self.dst_aux_row is not None


class KVTransport(Protocol):
    """One node's endpoint (a NIXL agent, or the in-process fake for unit tests)."""

    @property
    def name(self) -> str: ...

    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to `add_peer` (NIXL agent metadata)."""

    def layout(self) -> MemoryLayout: ...

    def add_peer(self, metadata: bytes, layout: MemoryLayout, *, connect: bool = True) -> str:
        """Load a peer from its metadata, connecting to it now when `connect` (the side that
        initiates transfers); returns the peer's name. Idempotent."""

    def remove_peer(self, name: str) -> None: ...

    def write(self, req: TransferRequest) -> object:
        """Post the write of pages (+ aux row when final: then the peer is notified with the room
        on completion)."""

    def poll(self, handle: object) -> KVPoll:
        """TRANSFERRING, SUCCESS, or FAILED for a posted write."""

    def release(self, handle: object) -> None: ...

    def last_error(self, handle: object) -> str | None:
        """Why a write polled FAILED (None when it did not fail or the reason is unknown)."""

    def notify(self, peer: str, message: bytes) -> None:
        """A small control message to the peer (e.g. 'room failed'), best effort."""

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """(peer name, message) pairs received since the last call, completions included."""

    def close(self) -> None: ...


def completion_tag(room: int) -> bytes:
    return f"done:{room}".encode()


def failure_tag(room: int, reason: str) -> bytes:
    return f"fail:{room}:{reason}".encode()


def parse_tag(msg: bytes) -> tuple[str, int, str]:
    """('done'|'fail'|'abort', room, reason) from a notification; ValueError on junk."""
    kind, _, rest = msg.decode(errors="replace").partition(":")
    room_s, _, reason = rest.partition(":")
    if kind not in ("done", "fail", "abort") or not room_s.isdigit():
        raise ValueError(f"not a transfer notification: {msg[:64]!r}")
    return kind, int(room_s), reason
