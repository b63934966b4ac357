"""One request's response stream: engine updates (scheduler thread) -> gRPC responses (asyncio).

Also where stop strings are enforced on a node: the node has the tokenizer, so it decodes the
tail incrementally and ends the request at the first stop string (SMG/the router trim the text).
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.core import FinishReason, Req
from engine.scheduler import RequestUpdate
from engine.service import convert
from common.detokenize import TextAssembler
from common.tokenizer import Tokenizer


class Aborter(Protocol):
    """Whoever can end a request early (the engine loop, or the PD facade over it)."""

    def abort(self, rid: str, reason: str = "aborted") -> None: ...


class RequestStream:
    def __init__(
        self, loop: Aborter, req: Req, stream: bool, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int]
    ) -> None:
        self.loop, self.req, self.stream = loop, req, stream
        self.eos = eos_token_ids
        self._aio = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        p = req.params
        self._text = (
            TextAssembler(tokenizer, p.stop, req.prompt_ids, p.min_new_tokens, p.skip_special_tokens)
            if (tokenizer and p.stop)
            else None
        )
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list = []
        self.accepted_drafts = 0
        self.verifies = 0
        self.finished = False

    def on_update(self, upd: RequestUpdate) -> None:
        """Called in the scheduler thread."""
        self._aio.call_soon_threadsafe(self._queue.put_nowait, upd)

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        rid, n_prompt = self.req.rid, len(self.req.prompt_ids)
        try:
            while True:
                upd = await self._queue.get()
                reason, matched = upd.finish_reason, None
                finished = upd.finished
                if self._text is not None and upd.tokens and not finished:
                    _, hit = self._text.feed(upd.tokens)
                    if hit:  # end it here; the scheduler frees the request on its next step
                        self.loop.abort(rid, "stop string")
                        finished, reason, matched = True, FinishReason.STOP, self._text.matched
                self._record(upd)
                if upd.tokens and self.stream:
                    yield convert.chunk(
                        rid,
                        upd.tokens,
                        n_prompt,
                        len(self.output_ids),
                        upd.logprobs or None,
                        upd.top_logprobs or None,
                        cached_tokens=upd.cached_tokens,
                    )
                if finished:
                    self.finished = True
                    if matched is None:
                        matched = convert.matched_stop_token(upd, self.req.params.stop_token_ids, self.eos)
                    if reason is FinishReason.ABORT and upd.finish_detail not in ("", "aborted"):
                        raise RequestFailed(upd.finish_detail)
                    yield convert.complete(
                        rid,
                        self.output_ids,
                        reason,
                        n_prompt,
                        logprobs=self.logprobs or None,
                        top=self.top or None,
                        matched_stop=matched,
                        accepted_drafts=self.accepted_drafts,
                        verifies=self.verifies,
                        cached_tokens=upd.cached_tokens,
                    )
                    return
        finally:
            if not self.finished:  # the client went away (or the handler was cancelled)
                self.loop.abort(rid, "client cancelled")

    def _record(self, upd: RequestUpdate) -> None:
        self.output_ids += upd.tokens
        self.logprobs += upd.logprobs
        self.top += upd.top_logprobs
        if upd.accepted_drafts is not None:
            self.accepted_drafts += upd.accepted_drafts
            self.verifies += 1


class RequestFailed(RuntimeError):
    """A request ended with an error; the servicer maps it to a gRPC status. `kind` is a short,
    fixed label for metrics (never free text: it is a Prometheus label value). `blame` names the
    role of the node at fault when that is not this one (a decode whose prefill peer failed it):
    the servicer sends it as trailing metadata, so the router charges the right node."""

    def __init__(self, message: str, kind: str = "other", blame: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.blame = kind, blame

    @classmethod
    def refused_alone(cls, role: str, work: str, flag: str) -> RequestFailed:
        """A request sent to a PD node alone (no partner) that the node's settings refuse: the
        router retries it elsewhere, since it is the node's setting, not the request's fault."""
        return cls(
            f"this {role} node does not {work} itself ({flag} 0): send disaggregated_params.bootstrap_host",
            "local_refused",
            blame=role,
        )
