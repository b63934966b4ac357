"""Aux ("metadata") rows: what a decode node needs besides the KV pages to start decoding.

One contiguous uint8 tensor of fixed-size rows is registered with the transport, so a request's
aux row moves as ONE descriptor next to its KV pages. A row holds the room echo (0 = empty), the
first sampled token, the EAGLE top-k (count, p, index; at most `topk_max`) and optionally the
draft hidden state. The prefill node fills a row with `write`; the decode node reads it with
`read` only after the completion notification AND `room_of(row) == its room`: the echo catches a
row that was never written, written for another request, or left over from an earlier one.

Byte layout of a row (offsets are identical on both sides for identical arguments, which is
why `row_bytes` goes in the handshake):

    0   room         int64
    8   first_token  int64
    16  topk count   int32 (+4 pad)
    24  topk_p       float32 x topk_max
    ..  topk_index   int64   x topk_max   (8-aligned)
    ..  hidden       hidden_size x hidden_dtype (16-aligned); absent when hidden_size == 0
    row_bytes = the above rounded up to 64 (RDMA-friendly, and keeps every field aligned)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_transfer.base import Region

_ROW_ALIGN = 64


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class AuxLayout:
    """Shape of one aux row. Keyword use is the norm: AuxLayout(hidden_size=..., hidden_dtype=...)."""

    hidden_size: int = 0
    hidden_dtype: torch.dtype = torch.float32
    topk_max: int = 16

    def __post_init__(self) -> None:
        if self.topk_max < 1:
            raise ValueError(f"topk_max must be >= 1, got {self.topk_max}")
        if self.hidden_size < 0:
            raise ValueError(f"hidden_size must be >= 0, got {self.hidden_size}")

    @property
    def topk_p_offset(self) -> int:
        return 24

    @property
    def topk_index_offset(self) -> int:
        return _round_up(self.topk_p_offset + 4 * self.topk_max, 8)

    @property
    def hidden_offset(self) -> int:
        return _round_up(self.topk_index_offset + 8 * self.topk_max, 16)

    @property
    def hidden_bytes(self) -> int:
        return self.hidden_size * self.hidden_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return _round_up(self.hidden_offset + self.hidden_bytes, _ROW_ALIGN)


@dataclass
class AuxRecord:
    """A decoded row (tensors are clones on the buffer's device; topk trimmed to its count)."""

    room: int
    first_token: int
    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden: torch.Tensor | None


class AuxBuffer:
    """`num_rows` aux rows in one registered tensor, with a FIFO row allocator (row 0 reserved)."""

    def __init__(self, layout: AuxLayout, num_rows: int, device: torch.device | str = "cpu") -> None:
        if num_rows < 2:
            raise ValueError("the aux buffer needs at least 2 rows (row 0 is reserved)")
        self.layout, self.num_rows = layout, num_rows
        rb = layout.row_bytes
        self.tensor = torch.zeros(num_rows, rb, dtype=torch.uint8, device=device)
        t, L = self.tensor, layout
        # Typed views into the same storage: a write is a plain tensor copy, no packing.
        self._room = t[:, 0:8].view(torch.int64)[:, 0]
        self._first = t[:, 8:16].view(torch.int64)[:, 0]
        self._count = t[:, 16:20].view(torch.int32)[:, 0]
        self._topk_p = t[:, L.topk_p_offset:L.topk_p_offset + 4 * L.topk_max].view(torch.float32)
        self._topk_i = t[:, L.topk_index_offset:L.topk_index_offset + 8 * L.topk_max].view(torch.int64)
        self._hidden = (t[:, L.hidden_offset:L.hidden_offset + L.hidden_bytes].view(L.hidden_dtype)
                        if L.hidden_size else None)
        # FIFO rather than LIFO: a just-freed row is reused last, so a late write aimed at it
        # (a bug elsewhere) has the longest possible time to be caught by the room echo.
        self._free: deque[int] = deque(range(1, num_rows))
        self._used: set[int] = set()

    # ---- allocation ----
    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

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
            raise RuntimeError(f"double free or foreign aux row {row}")
        self._used.remove(row)
        # Zero the whole row, echo included: a stale row must never pass the decode-side check.
        self.tensor[row].zero_()
        self._free.append(row)

    def check(self) -> None:
        """Invariant: every row but 0 is free or used, never both, never lost."""
        assert self.num_free + self.num_used == self.num_rows - 1, (self.num_free, self.num_used)
        assert not self._used.intersection(self._free)
        assert 0 not in self._used and 0 not in self._free

    # ---- contents ----
    def _check_row(self, row: int) -> None:
        if not 0 < row < self.num_rows:
            raise IndexError(f"aux row {row} out of range 1..{self.num_rows - 1}")

    def write(self, row: int, room: int, first_token: int,
              topk_p: torch.Tensor | Sequence[float] | None = None,
              topk_index: torch.Tensor | Sequence[int] | None = None,
              hidden: torch.Tensor | None = None) -> None:
        """Prefill side: fill `row` for `room` (topk_p and topk_index go together)."""
        self._check_row(row)
        if not 0 < room < 2**63:
            raise ValueError(f"room must be in 1..2**63-1 (0 means empty), got {room}")
        L = self.layout
        k = 0
        if (topk_p is None) != (topk_index is None):
            raise ValueError("topk_p and topk_index must be given together")
        if topk_p is not None and topk_index is not None:
            p = torch.as_tensor(topk_p).flatten()
            idx = torch.as_tensor(topk_index).flatten()
            k = p.numel()
            if k != idx.numel() or k > L.topk_max:
                raise ValueError(f"topk sizes {k}/{idx.numel()} must match and be <= {L.topk_max}")
            self._topk_p[row].zero_()
            self._topk_i[row].zero_()
            self._topk_p[row, :k].copy_(p)
            self._topk_i[row, :k].copy_(idx)
        if hidden is not None:
            if self._hidden is None:
                raise ValueError("this aux layout carries no hidden state (hidden_size=0)")
            h = hidden.reshape(-1)
            if h.numel() != L.hidden_size:
                raise ValueError(f"hidden has {h.numel()} elements, layout says {L.hidden_size}")
            self._hidden[row].copy_(h)
        self._first[row] = int(first_token)
        self._count[row] = k
        self._room[row] = int(room)

    def read(self, row: int) -> AuxRecord:
        """Decode side: a copy of the row, so the row can be freed right after."""
        self._check_row(row)
        k = int(self._count[row])
        if not 0 <= k <= self.layout.topk_max:
            raise ValueError(f"aux row {row} has a corrupt topk count {k}")
        return AuxRecord(
            room=int(self._room[row]), first_token=int(self._first[row]),
            topk_p=self._topk_p[row, :k].clone(), topk_index=self._topk_i[row, :k].clone(),
            hidden=None if self._hidden is None else self._hidden[row].clone())

    def room_of(self, row: int) -> int:
        self._check_row(row)
        return int(self._room[row])

    def region(self) -> Region:
        dev = self.tensor.get_device()
        return Region(addr=self.tensor.data_ptr(), item_bytes=self.row_bytes, count=self.num_rows,
                      device_id=max(dev, 0))
