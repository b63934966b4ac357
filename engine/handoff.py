"""What a prefill node hands a decode node besides KV pages: one row of bytes.

A row is a header every algorithm shares (the first sampled token, its logprob and top
logprobs) followed by the algorithm's own payload, whose layout, encoding and decoding belong to
the algorithm's `HandoffCodec` (EAGLE's carries the draft top-k and hidden state; plain decoding
carries nothing). The transport moves the row as opaque bytes (engine/kv_transfer/rows.py).

Header layout (little-endian, fixed for every algorithm):

    0    first_token   int64
    8    logprob       float32   (NaN when the request did not ask for logprobs)
    12   num_top       int32     (<= MAX_TOP_LOGPROBS)
    16   top_ids       int64 x MAX_TOP_LOGPROBS
    176  top_values    float32 x MAX_TOP_LOGPROBS
    256  payload       codec.payload_bytes
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.core import Req

MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and SamplingParams'
HEADER_BYTES = 256


class HandoffError(ValueError):
    """A handoff row that cannot be encoded or decoded; the message says what is wrong."""


class HandoffCodec(Protocol):
    """An algorithm's part of the handoff row."""

    @property
    def payload_bytes(self) -> int:
        """Bytes of the algorithm's payload (0: nothing beyond the header)."""

    def encode(self, req: Req) -> torch.Tensor:
        """uint8 (payload_bytes,) on the CPU from a finished prefill request (its spec state)."""

    def decode(self, payload: torch.Tensor) -> Any:
        """The algorithm's per-request handoff state from a uint8 payload; it becomes `Req.handoff`
        and is read by the algorithm's `build_disagg_draft_input`."""


class NoPayloadCodec:
    """Algorithms that need nothing but the first token (plain decoding, n-gram lookup)."""

    payload_bytes = 0

    def encode(self, req: Req) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.uint8)

    def decode(self, payload: torch.Tensor) -> Any:
        return None


@dataclass
class HandoffHeader:
    first_token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)

    @staticmethod
    def of(req: Req) -> "HandoffHeader":
        """The header of a finished prefill request: its one sampled token and what was asked of it."""
        lp = req.output_logprobs[0] if req.output_logprobs else None
        top = req.output_top_logprobs[0] if req.output_top_logprobs else []
        return HandoffHeader(req.output_ids[0], lp, list(top)[:MAX_TOP_LOGPROBS])


def encode_row(header: HandoffHeader, payload: torch.Tensor, payload_bytes: int) -> torch.Tensor:
    """One handoff row (uint8, HEADER_BYTES + payload_bytes) on the CPU."""
    if payload.dtype != torch.uint8 or payload.numel() != payload_bytes:
        raise HandoffError(
            f"codec payload has {payload.numel()} {payload.dtype} elements, expected {payload_bytes} uint8"
        )
    row = torch.zeros(HEADER_BYTES + payload_bytes, dtype=torch.uint8)
    row[0:8].view(torch.int64)[0] = header.first_token
    row[8:12].view(torch.float32)[0] = math.nan if header.logprob is None else header.logprob
    top = header.top_logprobs[:MAX_TOP_LOGPROBS]
    row[12:16].view(torch.int32)[0] = len(top)
    if top:
        row[16 : 16 + 8 * len(top)].view(torch.int64).copy_(torch.tensor([t for t, _ in top]))
        row[176 : 176 + 4 * len(top)].view(torch.float32).copy_(torch.tensor([v for _, v in top]))
    row[HEADER_BYTES:] = payload.reshape(-1).cpu()
    return row


def decode_row(row: torch.Tensor) -> tuple[HandoffHeader, torch.Tensor]:
    """(header, payload) of a handoff row; HandoffError on a corrupt header."""
    if row.numel() < HEADER_BYTES:
        raise HandoffError(f"handoff row has {row.numel()} bytes, the header alone needs {HEADER_BYTES}")
    row = row.reshape(-1).cpu()
    first = int(row[0:8].view(torch.int64)[0])
    lp = float(row[8:12].view(torch.float32)[0])
    n = int(row[12:16].view(torch.int32)[0])
    if first < 0 or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise HandoffError(f"corrupt handoff header (first token {first}, {n} top logprobs)")
    ids = row[16 : 16 + 8 * n].view(torch.int64).tolist()
    vals = row[176 : 176 + 4 * n].view(torch.float32).tolist()
    header = HandoffHeader(first, None if math.isnan(lp) else lp, list(zip(ids, vals)))
    return header, row[HEADER_BYTES:].clone()
