"""Token windows a draft model reads after the target: the chunk shifted left by one at prefill,
and the emitted tokens of a verify at decode (draft-extend), in fixed-width windows.

Shared by every worker whose draft keeps KV at the target's slots "one token ahead" (slot j holds
the draft's view of token j + 1): EAGLE heads, and plugins driving a small draft LM the same way.
"""

from __future__ import annotations

import torch

from engine.core import Batch
from spec.rejection import VerifyResult


def shifted_tokens(batch: Batch) -> list[int]:
    """Each window's tokens shifted left by one; the tail is the next prompt token, or a
    placeholder where the window samples (the sampled token is written in on the device)."""
    shifted: list[int] = []
    for req, p, n, s in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample):
        shifted += req.tokens(p + 1, p + n)
        shifted.append(0 if s else req.tokens(p + n, p + n + 1)[0])
    return shifted


def emitted_window(vr: VerifyResult, width: int) -> torch.Tensor:
    """(bs, width) tokens following each accepted window row: accepted drafts, then the new
    bonus token, padded with the bonus (rows past the accepted length only scribble beyond
    seq_len)."""
    bs = vr.bonus.shape[0]
    emitted = torch.where(vr.emitted >= 0, vr.emitted, vr.bonus.unsqueeze(1))
    if emitted.shape[1] < width:
        emitted = torch.cat((emitted, vr.bonus.unsqueeze(1).expand(bs, width - emitted.shape[1])), 1)
    return emitted[:, :width]


def last_accepted_rows(vr: VerifyResult, width: int) -> torch.Tensor:
    """Flat row of each request's last accepted token in a (bs * width) draft-extend output."""
    bs = vr.accept_lens.shape[0]
    return torch.arange(bs, device=vr.accept_lens.device) * width + vr.accept_lens - 1
