"""EAGLE's part of the PD handoff row: the draft's top-k after the bonus token and its hidden state.

Payload layout (offsets fixed by (topk, hidden size, dtype), so identical configurations agree
byte for byte; the size goes into the pairing fingerprint through the row size):

    0   count        int32 (+4 pad)
    8   topk_p       float32 x topk
    ..  topk_index   int64   x topk   (8-aligned)
    ..  hidden       hidden_size x dtype (16-aligned)
"""

from __future__ import annotations

import torch

from engine.core import Req
from engine.handoff import HandoffError
from spec.draft_input import EagleReqState


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class EagleHandoffCodec:
    def __init__(self, topk: int, hidden_size: int, hidden_dtype: torch.dtype) -> None:
        if topk < 1 or hidden_size < 1:
            raise ValueError(f"EAGLE handoff needs topk >= 1 and a hidden size, got {topk}, {hidden_size}")
        self.topk, self.hidden_size, self.hidden_dtype = topk, hidden_size, hidden_dtype
        self._p = 8
        self._i = _round_up(self._p + 4 * topk, 8)
        self._h = _round_up(self._i + 8 * topk, 16)
        self.payload_bytes = self._h + hidden_size * hidden_dtype.itemsize

    def encode(self, req: Req) -> torch.Tensor:
        st = req.spec_state
        if not isinstance(st, EagleReqState):
            raise HandoffError(f"request {req.rid} finished prefill without EAGLE draft state")
        k = int(st.topk_p.numel())
        if k != self.topk or st.hidden.numel() != self.hidden_size:
            raise HandoffError(
                f"request {req.rid}: draft state has top-{k} and hidden {st.hidden.numel()}, "
                f"the codec carries top-{self.topk} and hidden {self.hidden_size}"
            )
        if st.copied is not None:  # host copies in flight since the prefill step: wait for them alone
            st.copied.wait()
        # Assembled where the state lives (the host once a prefill's copies have landed, so the
        # last copy is a no-op there), then one copy to the host: each device-to-host copy waits
        # for the device, and this runs on the handoff's critical path.
        out = torch.zeros(self.payload_bytes, dtype=torch.uint8, device=st.hidden.device)
        out[0:4].view(torch.int32).fill_(k)
        out[self._p : self._p + 4 * k].view(torch.float32).copy_(st.topk_p.detach().float())
        out[self._i : self._i + 8 * k].view(torch.int64).copy_(st.topk_index.detach())
        out[self._h :].view(self.hidden_dtype).copy_(st.hidden.detach().reshape(-1))
        return out.cpu()

    def decode(self, payload: torch.Tensor) -> EagleReqState:
        if payload.numel() < self.payload_bytes:
            raise HandoffError(f"EAGLE handoff payload has {payload.numel()} bytes, needs {self.payload_bytes}")
        data = payload.reshape(-1)[: self.payload_bytes].cpu().clone()
        k = int(data[0:4].view(torch.int32)[0])
        if k != self.topk:
            raise HandoffError(f"EAGLE handoff carries top-{k}, this decode node verifies top-{self.topk}")
        return EagleReqState(
            data[self._p : self._p + 4 * k].view(torch.float32).clone(),
            data[self._i : self._i + 8 * k].view(torch.int64).clone(),
            data[self._h :].view(self.hidden_dtype).clone(),
        )
