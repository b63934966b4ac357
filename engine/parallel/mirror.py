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

from common.sampling import Constraint
from engine.core import Req
from engine.grammar.base import GrammarMatcher

_BULKY = {
    "rid",
    "prompt_ids",
    "params",
    "output_ids",
    "output_logprobs",
    "output_top_logprobs",
    "spec_state",
    "handoff",
    "grammar",  # each rank keeps its own matcher (ReqMirror)
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
    """A follower's copies of the leader's requests. A constrained request gets its own matcher
    (`grammar_for`), kept at the tokens its output holds, as the leader's scheduler keeps its own:
    this rank's sampler and drafts then mask exactly as the leader's do."""

    def __init__(self, device: torch.device, grammar_for: Callable[[Constraint], GrammarMatcher] | None = None) -> None:
        self.device, self.grammar_for = device, grammar_for
        self.reqs: dict[str, Req] = {}
        self._taken: dict[str, int] = {}  # output tokens offered to each request's matcher

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
        if req.params.constraint is not None:
            self._sync_grammar(req)
        return req

    def _sync_grammar(self, req: Req) -> None:
        """Offer the matcher the output tokens it has not seen (one refused, as the leader's
        scheduler refuses EOS and a token outside the grammar, is not consumed)."""
        assert self.grammar_for is not None and req.params.constraint is not None
        taken = self._taken.get(req.rid, 0)
        if req.grammar is None or taken > len(req.output_ids):  # new, or output taken back: start over
            req.grammar, taken = self.grammar_for(req.params.constraint), 0
        for tok in req.output_ids[taken:]:
            req.grammar.advance((tok,))
        self._taken[req.rid] = len(req.output_ids)

    def forget(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self._taken.pop(rid, None)


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
