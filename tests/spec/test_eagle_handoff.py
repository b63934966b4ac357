"""EAGLE's handoff codec: the draft top-k and hidden state survive a row byte for byte, in every
dtype and top-k; mismatched or missing state is a clear error."""

from __future__ import annotations

import pytest
import torch

from engine.core import Req, SamplingParams
from engine.handoff import HandoffError
from spec.draft_input import EagleReqState
from spec.eagle_handoff import EagleHandoffCodec
from spec.eagle_worker import _keep_handoff


@pytest.mark.parametrize(
    "k,hidden,dtype",
    [(1, 64, torch.bfloat16), (4, 48, torch.float32), (16, 7, torch.bfloat16), (3, 384, torch.float16)],
)
def test_round_trip(k: int, hidden: int, dtype: torch.dtype) -> None:
    codec = EagleHandoffCodec(k, hidden, dtype)
    assert codec.payload_bytes >= 8 + 12 * k + hidden * dtype.itemsize
    st = EagleReqState(torch.rand(k), torch.randint(0, 2**40, (k,)), torch.randn(hidden).to(dtype))
    req = Req("r", [1], SamplingParams(), spec_state=st)
    payload = codec.encode(req)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes
    got = codec.decode(payload)
    assert torch.equal(got.topk_p, st.topk_p) and torch.equal(got.topk_index, st.topk_index)
    assert got.hidden.dtype == dtype and torch.equal(got.hidden, st.hidden)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_state_on_the_gpu_is_encoded_to_a_host_row() -> None:
    """On a GPU the payload is assembled on the device and copied to the host once."""
    codec = EagleHandoffCodec(4, 4096, torch.bfloat16)
    dev = torch.device("cuda")
    st = EagleReqState(
        torch.rand(4, device=dev),
        torch.randint(0, 2**40, (4,), device=dev),
        torch.randn(4096, device=dev).to(torch.bfloat16),
    )
    payload = codec.encode(Req("r", [1], SamplingParams(), spec_state=st))
    assert payload.device.type == "cpu" and payload.numel() == codec.payload_bytes
    got = codec.decode(payload)
    assert torch.equal(got.topk_p, st.topk_p.cpu()) and torch.equal(got.topk_index, st.topk_index.cpu())
    assert torch.equal(got.hidden, st.hidden.cpu())


def _held_batch(dev: torch.device) -> tuple[list[Req], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three finished prompts, the first and last leaving the node (hold_kv), and their draft rows."""
    reqs = [Req(f"r{i}", [1], SamplingParams()) for i in range(3)]
    reqs[0].hold_kv = reqs[2].hold_kv = True
    p, idx = torch.rand(3, 4, device=dev), torch.randint(0, 2**40, (3, 4), device=dev)
    return reqs, p, idx, torch.randn(3, 64, device=dev).to(torch.bfloat16)


def test_the_prefill_keeps_the_draft_rows_of_the_requests_that_leave() -> None:
    reqs, p, idx, g = _held_batch(torch.device("cpu"))
    _keep_handoff(reqs, p, idx, g)
    assert reqs[1].spec_state is None  # it stays: its FutureMap row is its state
    codec = EagleHandoffCodec(4, 64, torch.bfloat16)
    for i in (0, 2):
        st = reqs[i].spec_state
        assert isinstance(st, EagleReqState) and st.copied is not None
        got = codec.decode(codec.encode(reqs[i]))
        assert torch.equal(got.topk_p, p[i]) and torch.equal(got.topk_index, idx[i]) and torch.equal(got.hidden, g[i])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_encoder_waits_for_the_prefills_copies_alone() -> None:
    """The draft rows leave for the host behind the kernels that made them; encoding them later
    (on the event loop) does not wait for what the scheduler queued since."""
    reqs, p, idx, g = _held_batch(torch.device("cuda"))
    _keep_handoff(reqs, p, idx, g)
    torch.cuda._sleep(2_000_000_000)  # the next batch's work, about a second of it
    codec = EagleHandoffCodec(4, 64, torch.bfloat16)
    payload = codec.encode(reqs[2])
    assert not torch.cuda.current_stream().query()  # encoded while that work still runs
    got = codec.decode(payload)
    assert torch.equal(got.topk_p, p[2].cpu()) and torch.equal(got.hidden, g[2].cpu())
    torch.cuda.synchronize()


def test_mismatches_are_refused() -> None:
    codec = EagleHandoffCodec(2, 8, torch.float32)
    with pytest.raises(HandoffError, match="without EAGLE draft state"):
        codec.encode(Req("r", [1], SamplingParams()))
    st = EagleReqState(torch.rand(3), torch.zeros(3, dtype=torch.int64), torch.zeros(8))
    with pytest.raises(HandoffError, match="top-3"):
        codec.encode(Req("r", [1], SamplingParams(), spec_state=st))
    other = EagleHandoffCodec(4, 8, torch.float32)
    st4 = EagleReqState(torch.rand(4), torch.zeros(4, dtype=torch.int64), torch.zeros(8))
    with pytest.raises(HandoffError, match="top-4"):
        codec.decode(other.encode(Req("r", [1], SamplingParams(), spec_state=st4)))
    with pytest.raises(HandoffError, match="needs"):
        codec.decode(torch.zeros(3, dtype=torch.uint8))
