"""The engine as PD nodes see it: a small facade over the scheduler thread, KV pages and handoff rows.

Prefill and decode handlers never touch the scheduler, KV manager or executor directly. They
reserve pages for a prompt, learn its page list, adopt a prebuilt request, release pages, and
encode / decode handoff rows through this object; every call that touches scheduler state runs
on the scheduler thread (`EngineLoop.call`) and returns a Future. Without a loop (a single-
threaded driver stepping the engine itself: the conformance kit, tests) the calls run inline.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.core import Batch, ForwardMode, Req, SamplingParams, StepOutput
from engine.future_map import DraftInput
from engine.grammar.base import CompiledGrammar
from engine.handoff import HandoffCodec, HandoffHeader, decode_row, encode_row
from engine.kv_cache import KVPool
from engine.loader import tp_layout
from engine.scheduler import RequestUpdate
from engine.loop import EngineLoop, UpdateCallback
from common.sampling import Constraint
from common.tokenizer import Tokenizer


@dataclass(frozen=True)
class Destination:
    """Where a prefill writes a prompt on this node: its pages in order, of which the first
    `cached` are the prefix cache's (held already: no write may land in them)."""

    pages: list[int]
    cached: int


class DisaggEngine:
    """What a prefill or decode node may ask of its engine."""

    def __init__(self, engine: Any, loop: EngineLoop | None = None) -> None:
        self.loop = loop
        self._engine = engine
        self.codec: HandoffCodec = engine.executor.handoff_codec()

    @classmethod
    def over(cls, loop: EngineLoop) -> "DisaggEngine":
        return cls(loop.engine, loop)

    def _call(self, fn: Callable[[], Any]) -> Future:
        if self.loop is not None:
            return self.loop.call(fn)
        fut: Future = Future()
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as the loop would
            fut.set_exception(e)
        return fut

    def _need_loop(self) -> EngineLoop:
        if self.loop is None:
            raise RuntimeError("this DisaggEngine drives no scheduler thread")
        return self.loop

    # ---- facts ----
    @property
    def config(self) -> Any:
        return self._engine.config

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    @property
    def max_context_len(self) -> int:
        return int(self._engine.max_context_len)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._engine.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self._engine.model_config.eos_token_ids)

    def kv_pools(self) -> list[KVPool]:
        """Target pool first, then the executor's (draft) pools: one page id addresses all."""
        return [self._engine.parts.runner.pool, *self._engine.executor.extra_kv_pools()]

    @property
    def tp_kv_heads(self) -> range:
        """The target's KV heads this node's leader rank holds (all of them on one GPU)."""
        mc = self._engine.model_config
        return tp_layout(mc, self._engine.ranks.group).kv_heads

    @property
    def num_kv_heads(self) -> int:
        """The target's KV heads over every rank."""
        return int(self._engine.model_config.num_kv_heads)

    @property
    def ranks(self) -> Any:
        """The node's tensor-parallel ranks (engine/parallel/ranks.py)."""
        return self._engine.ranks

    @property
    def kv_bytes_per_page(self) -> int:
        """Bytes one page moves across every pool, layer and K/V."""
        return sum(p.page_bytes * p.num_layers * 2 for p in self.kv_pools())

    def allocate_whole_runs(self) -> None:
        """Its KV is written to or from other nodes: allocations of several pages come as one run
        where evicting cached pages can make one (engine/kv_cache.py, `whole_runs`)."""
        self._engine.kv.whole_runs = True

    def pages_for(self, num_tokens: int) -> int:
        return self._engine.kv.pages_for(num_tokens)

    @property
    def handoff_bytes(self) -> int:
        """Payload bytes of one handoff row (shared header + the algorithm's part)."""
        from engine.handoff import HEADER_BYTES

        return HEADER_BYTES + self.codec.payload_bytes

    # ---- requests ----
    def make_request(self, ids: list[int], params: SamplingParams, rid: str | None = None) -> Req:
        return self._engine.make_request(ids, params, rid)

    def submit(self, req: Req, on_update: UpdateCallback) -> None:
        self._need_loop().submit(req, on_update)

    def compile_grammar(self, constraint: Constraint) -> Future[CompiledGrammar]:
        """The constraint's compiled grammar (engine.Engine.compile_grammar): each side of a
        handoff compiles its own from the same constraint, or finds it in its cache."""
        return self._engine.compile_grammar(constraint)

    def subscribe(self, rid: str, on_update: UpdateCallback) -> None:
        self._need_loop().io.subscribe(rid, on_update)

    def in_flight(self, rid: str) -> bool:
        """Is a request with this id live in the engine (submitted or adopted, not finished)?"""
        return self._need_loop().io.in_flight(rid)

    def abort(self, rid: str, reason: str = "aborted") -> None:
        self._need_loop().abort(rid, reason)

    # ---- pages (scheduler thread) ----
    def reserve_prompt(self, req: Req) -> Future:
        """Future[Destination | None]: a slot and pages for the prompt if admission by KV budget
        allows, and where they are, in one visit to the scheduler thread (each visit waits for a
        step boundary: under load a decode step or more before the prefill may write)."""
        return self._call(lambda: self._reserve(req))

    def _reserve(self, req: Req) -> Destination | None:
        """The prompt's first pages come from the prefix cache when it has them: the prefill
        node then writes only the rest."""
        eng = self._engine
        need = len(req.prompt_ids) + eng.executor.kv_tokens_per_decode()
        if not eng.kv.admit(req, len(req.prompt_ids), need):
            return None
        return Destination(eng.kv.page_list(req), eng.kv.cached_pages(req))

    def page_list(self, req: Req) -> Future:
        """Future[list[int]]: the request's pages in order."""
        return self._call(lambda: self._engine.kv.page_list(req))

    def release(self, req: Req) -> Future:
        """Return the request's pages and slot (deferred while a forward still uses them)."""
        return self._call(lambda: self._engine.scheduler.release_kv(req))

    def adopt(self, req: Req, draft_input: DraftInput, header: HandoffHeader) -> Future:
        """The prebuilt request joins the running batch with its first token; its updates go to
        the subscriber of its id."""
        return self._call(lambda: self._adopt(req, draft_input, header))

    def _adopt(self, req: Req, draft_input: DraftInput, header: HandoffHeader) -> None:
        out = StepOutput(tokens=[[header.first_token]])
        if header.logprob is not None:
            out.logprobs = [[header.logprob]]
            out.top_logprobs = [[list(header.top_logprobs)]]
        updates = self._engine.scheduler.adopt_prebuilt([req], draft_input, out)
        self._engine.io.publish(updates)

    def fail(self, req: Req, detail: str) -> Future:
        """End a request that cannot start (its pages go back); its subscriber is told."""
        return self._call(lambda: self._engine.io.publish([self._fail(req, detail)]))

    def _fail(self, req: Req, detail: str) -> RequestUpdate:
        return self._engine.scheduler.fail(req, detail)

    # ---- handoff rows ----
    def encode_handoff(self, req: Req) -> torch.Tensor:
        """The row payload of a finished prefill request (header + the algorithm's part)."""
        return encode_row(HandoffHeader.of(req), self.codec.encode(req), self.codec.payload_bytes)

    def decode_handoff(self, payload: torch.Tensor) -> tuple[HandoffHeader, Any]:
        """(header, the algorithm's per-request state) of a received row payload."""
        header, rest = decode_row(payload)
        return header, self.codec.decode(rest[: self.codec.payload_bytes])

    @staticmethod
    def prebuilt(req: Req) -> Batch:
        return Batch(ForwardMode.PREBUILT, [req])
