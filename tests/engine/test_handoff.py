"""Handoff rows' shared header: the first token and its logprobs round-trip; corrupt headers are
refused; the algorithm's payload is carried byte for byte."""

from __future__ import annotations

import pytest
import torch

from engine.core import Req, SamplingParams
from engine.handoff import (
    HEADER_BYTES,
    MAX_TOP_LOGPROBS,
    HandoffError,
    HandoffHeader,
    NoPayloadCodec,
    decode_row,
    encode_row,
)


def test_header_and_payload_round_trip() -> None:
    top = [(i * 7, -0.5 * i) for i in range(MAX_TOP_LOGPROBS)]
    payload = torch.randint(0, 256, (37,), dtype=torch.uint8)
    row = encode_row(HandoffHeader(2**40 + 3, -1.25, top), payload, 37)
    assert row.dtype == torch.uint8 and row.numel() == HEADER_BYTES + 37
    header, rest = decode_row(row)
    assert header.first_token == 2**40 + 3 and header.logprob == -1.25
    assert header.top_logprobs == top and torch.equal(rest, payload)


def test_header_without_logprobs_and_from_a_request() -> None:
    req = Req("r", [1, 2], SamplingParams(), output_ids=[9])
    header, _ = decode_row(encode_row(HandoffHeader.of(req), torch.zeros(0, dtype=torch.uint8), 0))
    assert (header.first_token, header.logprob, header.top_logprobs) == (9, None, [])
    req.output_logprobs, req.output_top_logprobs = [-0.75], [[(9, -0.75), (4, -1.5)]]
    header, _ = decode_row(encode_row(HandoffHeader.of(req), NoPayloadCodec().encode(req), 0))
    assert header.logprob == -0.75 and header.top_logprobs == [(9, -0.75), (4, -1.5)]


def test_bad_rows_are_refused() -> None:
    with pytest.raises(HandoffError, match="header alone"):
        decode_row(torch.zeros(10, dtype=torch.uint8))
    row = encode_row(HandoffHeader(1), torch.zeros(0, dtype=torch.uint8), 0)
    row[12:16].view(torch.int32)[0] = MAX_TOP_LOGPROBS + 1
    with pytest.raises(HandoffError, match="corrupt"):
        decode_row(row)
    with pytest.raises(HandoffError, match="expected 8 uint8"):
        encode_row(HandoffHeader(1), torch.zeros(4, dtype=torch.uint8), 8)
