"""Handoff rows: one fixed-size row of bytes per in-flight PD request, moved next to its KV pages.

One contiguous uint8 tensor of rows is registered with the transport, so a request's row moves as
ONE descriptor with its pages (in the same NIXL transfer when it lives in the KV's memory kind,
else as a second stage after them). The transport knows nothing of what a row holds beyond the room
echo at its start: the prefill node writes the row (room echo + payload bytes, see
engine/handoff.py) and the decode node reads it only after the completion notification AND
`room_of(row) == its echo`, which catches a row never written, written for another request, or
left over from an earlier one. Freeing a row zeroes it, echo included.

A row is written and read whole, in one copy. Rows in VRAM are copied on a stream of their own:
on the compute stream every handoff would wait for the forwards queued on it (another request's
prompt chunk on a prefill node, the running batch's steps on a decode node). Nothing on the
compute stream touches rows, and every access waits for its copy, so no ordering is lost.

Byte layout of a row:

    0   room      int64 (0 = empty)
    8   payload   payload_bytes (opaque)
    row_bytes = the above rounded up to 64 (RDMA-friendly, keeps every field 8-aligned)
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import torch

from engine.kv_transfer.base import Region

_ROW_ALIGN = 64
PAYLOAD_OFFSET = 8


def row_bytes_for(payload_bytes: int) -> int:
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
    return -(-(PAYLOAD_OFFSET + payload_bytes) // _ROW_ALIGN) * _ROW_ALIGN


class HandoffRows:
    """`num_rows` rows in one registered tensor, with a FIFO row allocator (row 0 reserved)."""

    def __init__(self, payload_bytes: int, num_rows: int, device: torch.device | str = "cpu") -> None:
        if num_rows < 2:
            raise ValueError("the handoff buffer needs at least 2 rows (row 0 is reserved)")
        self.payload_bytes, self.num_rows = payload_bytes, num_rows
        self.row_bytes = row_bytes_for(payload_bytes)
        self.tensor = torch.zeros(num_rows, self.row_bytes, dtype=torch.uint8, device=device)
        self._room = self.tensor[:, 0:8].view(torch.int64)[:, 0]
        # FIFO rather than LIFO: a just-freed row is reused last, so a late write aimed at it
        # (a bug elsewhere) has the longest possible time to be caught by the room echo.
        self._free: deque[int] = deque(range(1, num_rows))
        self._used: set[int] = set()
        self._stream = torch.cuda.Stream(self.tensor.device) if self.tensor.is_cuda else None

    # ---- allocation ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.popleft()
        self._used.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._used:
            raise RuntimeError(f"double free or foreign handoff row {row}")
        self._used.remove(row)
        with self._own_stream():
            self.tensor[row].zero_()  # a stale row must never pass the decode-side echo check
            self._settle()  # before a peer can be told to write into it again
        self._free.append(row)

    def check(self) -> None:
        """Invariant: every row but 0 is free or used, never both, never lost."""
        assert self.num_free + self.num_used == self.num_rows - 1, (self.num_free, self.num_used)
        assert not self._used.intersection(self._free)
        assert 0 not in self._used and 0 not in self._free

    # ---- contents ----
    def _check_row(self, row: int) -> None:
        if not 0 < row < self.num_rows:
            raise IndexError(f"handoff row {row} out of range 1..{self.num_rows - 1}")

    def write(self, row: int, room_echo: int, payload: torch.Tensor) -> None:
        """Prefill side: the echo and `payload` (uint8, at most payload_bytes; the rest zeroed),
        assembled on the host and copied into the row at once."""
        self._check_row(row)
        if not 0 < room_echo < 2**63:
            raise ValueError(f"room echo must be in 1..2**63-1 (0 means empty), got {room_echo}")
        data = payload.reshape(-1)
        if data.dtype != torch.uint8 or data.numel() > self.payload_bytes:
            raise ValueError(f"payload of {data.numel()} {data.dtype} elements does not fit {self.payload_bytes} bytes")
        host = torch.zeros(self.row_bytes, dtype=torch.uint8)
        host[0:PAYLOAD_OFFSET].view(torch.int64)[0] = int(room_echo)
        host[PAYLOAD_OFFSET : PAYLOAD_OFFSET + data.numel()].copy_(data)
        with self._own_stream():
            self.tensor[row].copy_(host)
            self._settle()

    @contextlib.contextmanager
    def _own_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def _settle(self) -> None:
        """Rows in VRAM: copies are stream-ordered, and the transport reads the row from its
        own streams; wait until they landed."""
        if self._stream is not None:
            self._stream.synchronize()

    def read(self, row: int) -> tuple[int, torch.Tensor]:
        """Decode side: (room echo, a host copy of the payload), so the row can be freed right
        after. One copy of the whole row: the echo and payload come from the same bytes."""
        host = self._host_row(row)
        return int(host[0:PAYLOAD_OFFSET].view(torch.int64)[0]), host[
            PAYLOAD_OFFSET : PAYLOAD_OFFSET + self.payload_bytes
        ].clone()

    def room_of(self, row: int) -> int:
        self._check_row(row)
        with self._own_stream():
            return int(self._room[row])

    def _host_row(self, row: int) -> torch.Tensor:
        self._check_row(row)
        with self._own_stream():
            return self.tensor[row].cpu()  # a blocking copy: done when it returns

    def region(self) -> Region:
        dev = self.tensor.get_device()
        return Region(
            addr=self.tensor.data_ptr(), item_bytes=self.row_bytes, count=self.num_rows, device_id=max(dev, 0)
        )
