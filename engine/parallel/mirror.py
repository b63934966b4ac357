"""Requests as the leader rank's scheduler sees them, kept in step on the follower ranks.

A follower runs no scheduler: its worker reads the same Req fields the leader's does, so before
each executor call the leader sends what changed of the requests the call touches (new ones whole,
then their scalar fields and the output tokens appended since), and followers apply it to their
own copies. Worker-owned state (`spec_state`) is never sent: each rank's worker keeps its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from engine.core import Req

_BULKY = {
    "rid",
    "prompt_ids",
    "params",
    "output_ids",
    "output_logprobs",
    "output_top_logprobs",
    "spec_state",
    "handoff",
}
SCALARS = tuple(f.name for f in dataclasses.fields(Req) if f.name not in _BULKY)

Encoded = tuple[str, tuple[Any, ...], int, list[int], Any, Any]  # rid, scalars, out from, tail, new, handoff


class ReqEncoder:
    """The leader's side: what each follower already knows of each request."""

    def __init__(self) -> None:
        self._sent_outputs: dict[str, int] = {}
        self._sent_handoff: dict[str, int] = {}

    def encode(self, req: Req) -> Encoded:
        rid, out = req.rid, req.output_ids
        new = None
        if rid not in self._sent_outputs:
            new = (list(req.prompt_ids), req.params)
        start = self._sent_outputs.get(rid, 0)
        if start > len(out):  # output was taken back (a PD first token is re-appended): resend
            start = 0
        self._sent_outputs[rid] = len(out)
        handoff = None
        if req.handoff is not None and self._sent_handoff.get(rid) != id(req.handoff):
            self._sent_handoff[rid] = id(req.handoff)
            handoff = map_tensors(req.handoff, lambda t: t.cpu())
        return rid, tuple(getattr(req, n) for n in SCALARS), start, list(out[start:]), new, handoff

    def forget(self, req: Req) -> None:
        """A finished request left the leader's scheduler."""
        self._sent_outputs.pop(req.rid, None)
        self._sent_handoff.pop(req.rid, None)


class ReqMirror:
    """A follower's copies of the leader's requests."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reqs: dict[str, Req] = {}

    def apply(self, enc: Encoded) -> Req:
        rid, scalars, start, tail, new, handoff = enc
        req = self.reqs.get(rid)
        if req is None or new is not None:
            assert new is not None, f"request {rid} was never sent whole"
            req = self.reqs[rid] = Req(rid, new[0], new[1])
        for name, value in zip(SCALARS, scalars):
            setattr(req, name, value)
        del req.output_ids[start:]
        req.output_ids.extend(tail)
        if handoff is not None:
            req.handoff = map_tensors(handoff, lambda t: t.to(self.device))
        return req

    def forget(self, rid: str) -> None:
        self.reqs.pop(rid, None)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with `fn` applied to every tensor in it (dataclasses, lists, tuples, dicts), so an
    object holding device tensors can cross to another rank's device through the host."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj
