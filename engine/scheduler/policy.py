"""Batch formation: admission by KV budget, chunked prefill under a token budget, retraction."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from common.defaults import DEFAULT_CHUNKED_PREFILL_SIZE, DEFAULT_MAX_RUNNING
from engine.core import Batch, DecodePlan, ForwardMode, Req, ReqState
from engine.kv_cache import KVCacheManager
from engine.page_allocator import OutOfPages
from engine.scheduler.tpot_guard import TpotGuard

ReqHook = Callable[[Req], None]


class DecodePlanner(Protocol):
    """The executor's side of planning decode steps (engine.executor.Executor has both)."""

    def kv_tokens_per_decode(self) -> int:
        """The largest window any decode step may use (admission headroom)."""
        ...

    def plan_decode(self, batch_size: int, room: int) -> DecodePlan:
        """How the next decode batch of this size runs; its window is at most `room` (>= 1)."""
        ...

    def supports_mixed_batches(self) -> bool:
        """May a plain decode step and a prompt chunk run as one MIXED batch?"""
        ...


@dataclass(frozen=True)
class PolicyConfig:
    max_running: int = DEFAULT_MAX_RUNNING
    # tokens one EXTEND batch may compute; prompts longer than this are chunked
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    # KV tokens kept free per running request at admission, so decode does not retract at once
    decode_reserve_tokens: int = 16
    # positions a request may ever hold: decode windows shrink to stay inside (None: no limit)
    max_context_len: int | None = None
    # under a TPOT guard, run a prompt chunk inside a decode step where the executor can, of at
    # most this many tokens (the mixed graphs' largest chunk: a larger one runs eagerly, paying
    # every launch from the host, a cost the guard does not price); None: no mixing
    mixed_chunk_tokens: int | None = None
    # a mixed chunk shorter than the prompt's rest is cut to the largest of these within the guard's
    # budget (the mixed graphs' chunk buckets: a padded token costs as much as a real one, and a
    # chunk padded past its budget would cost more than the guard allowed); empty: any size
    mixed_chunk_sizes: tuple[int, ...] = ()


def fit_chunk(budget: int, want: int, sizes: tuple[int, ...]) -> int:
    """A mixed chunk's tokens within `budget` for a prompt that needs `want` more: all of them when
    they fit, else the largest of `sizes` (ascending) within the budget; the budget itself when
    `sizes` is empty or none fits (a chunk below the smallest size is padded up to it)."""
    if budget >= want or not sizes:
        return budget
    i = bisect.bisect_right(sizes, budget)
    return sizes[i - 1] if i else budget


class BatchPolicy:
    """Prefill first (new and partially prefilled requests), otherwise one decode step for all.

    With a TPOT guard (a decode node that also runs prompts) decoding requests come first: a prompt
    chunk runs only when the guard says their slack pays for it, and never two in a row, so
    prompts keep the decoding requests within the guard's time per output token. With mixed
    chunks, the chunk (one request's) rides inside the decode step instead: one MIXED forward.

    Admission reserves pages for a request's whole remaining prompt plus a decode reserve, so a
    chunked prefill never stalls halfway for lack of pages; decode grows pages step by step and
    retracts the newest request when the pool runs dry.
    """

    def __init__(
        self, cfg: PolicyConfig, kv: KVCacheManager, planner: DecodePlanner, guard: TpotGuard | None = None
    ) -> None:
        self.cfg, self.kv, self.planner, self.guard = cfg, kv, planner, guard
        self.mixes = guard is not None and bool(cfg.mixed_chunk_tokens) and planner.supports_mixed_batches()
        self._chunk_ran = False  # the last batch was a prompt chunk (the guard's alternation)
        # prompt tokens queued and not computed yet (waiting requests, unfinished chunks), as of
        # the last prompt batch formed; load reports read it from other threads
        self.queued_prompt_tokens = 0
        self.kv_tokens_per_decode = planner.kv_tokens_per_decode()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted: prefilling or decoding, in admission order

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def next_batch(self, on_admit: ReqHook, on_retract: ReqHook) -> Batch:
        solo = self._solo_batch(on_admit, on_retract)
        if solo is not None:
            return solo
        decoding = self._decoding()
        budget = self.cfg.chunked_prefill_size
        if self.guard is not None and decoding and (want := self._next_prompt_tokens()):
            if self.mixes:
                budget = min(self.guard.chunk_tokens(decoding, want, mixed=True), self.cfg.mixed_chunk_tokens or 0)
                budget = fit_chunk(budget, want, self.cfg.mixed_chunk_sizes)
                return self._mixed_batch(on_admit, on_retract, decoding, budget)
            budget = 0 if self._chunk_ran else self.guard.chunk_tokens(decoding, want)
            if budget <= 0:  # a decode step between two prompt chunks, or until slack pays for one
                self._chunk_ran = False
                return self._decode_batch(on_retract, decoding)
        batch = self._prefill_batch(on_admit, budget)
        if batch is not None:
            self._chunk_ran = True
            return batch
        self._chunk_ran = False
        return self._decode_batch(on_retract, decoding)

    def _mixed_batch(self, on_admit: ReqHook, on_retract: ReqHook, decoding: list[Req], budget: int) -> Batch:
        """The decode step, with a chunk of one prompt inside it when `budget` allows one. The
        decode windows are reserved first: running requests keep their pages before a prompt
        is admitted."""
        decode = self._decode_batch(on_retract, decoding)
        if budget <= 0:
            return decode
        chunk = self._prefill_batch(on_admit, budget, max_reqs=1)
        if chunk is None:
            return decode
        if decode.mode is not ForwardMode.DECODE or decode.plan.steps or decode.window != 1:
            return chunk if decode.mode is ForwardMode.IDLE else decode  # (an executor that mixes plans plain steps)
        return Batch.mixed(decode, chunk)

    def _next_prompt_tokens(self) -> int:
        """Tokens the next prompt to run still needs (a chunked one first); 0: none waits."""
        for req in self.running:
            if req.needs_extend:
                return req.num_uncomputed
        return self.waiting[0].num_uncomputed if self.waiting else 0

    def _solo_batch(self, on_admit: ReqHook, on_retract: ReqHook) -> Batch | None:
        """A request under suspicion (engine.scheduler isolates the members of a failed batch)
        runs alone until it proves innocent or fails by itself."""
        req = next((r for r in self.running if r.solo), None)
        if req is None:
            if not (self.waiting and self.waiting[0].solo):
                return None
            head = self.waiting[0]
            if not self._try_admit(head):
                return None
            self.waiting.popleft()
            self.running.append(head)
            on_admit(head)
            req = head
        if req.needs_extend:
            n = chunk_len(req, self.cfg.chunked_prefill_size, self.cfg.chunked_prefill_size)
            return Batch(ForwardMode.EXTEND, [req], [n], [req.sched_len + n == req.total_len])
        if req.is_decoding and not req.will_finish:
            return self._decode_batch(on_retract, [req])
        return None

    # ---- prefill ----
    def _prefill_batch(self, on_admit: ReqHook, budget: int, max_reqs: int | None = None) -> Batch | None:
        """Prompt chunks within `budget` tokens, chunked prefills first, of at most `max_reqs`
        requests (None: any number)."""
        room = max_reqs if max_reqs is not None else self.cfg.max_running
        reqs: list[Req] = []
        lens: list[int] = []
        queued = sum(r.num_uncomputed for r in self.waiting)
        for req in self.running:  # continue chunked prefills first
            if req.needs_extend:
                queued += req.num_uncomputed
                n = chunk_len(req, budget, self.cfg.chunked_prefill_size) if len(reqs) < room else 0
                if n > 0:
                    reqs.append(req)
                    lens.append(n)
                    budget -= n
        self.queued_prompt_tokens = queued
        while self.waiting and budget > 0 and len(reqs) < room and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            if req.solo or not self._try_admit(req):  # a suspect is admitted alone (_solo_batch)
                break
            self.waiting.popleft()
            self.running.append(req)
            on_admit(req)
            n = chunk_len(req, budget, self.cfg.chunked_prefill_size)
            if n > 0:
                reqs.append(req)
                lens.append(n)
                budget -= n
        if not reqs:
            return None
        sample = [r.sched_len + n == r.total_len for r, n in zip(reqs, lens)]
        return Batch(ForwardMode.EXTEND, reqs, lens, sample)

    def _try_admit(self, req: Req) -> bool:
        if req.release_pending:  # retracted while in flight: its old pages are not back yet
            return False
        need = req.total_len + self.kv_tokens_per_decode
        headroom = sum(self.kv.pages_for(self.cfg.decode_reserve_tokens) for _ in self.running)
        if not self.kv.admit(req, req.total_len, need, headroom):
            return False
        if not req.output_ids:  # the prompt's own hit (a retracted request re-reads its output too)
            req.cached_tokens = min(self.kv.cached_tokens(req), len(req.prompt_ids))
        req.state = ReqState.RUNNING
        return True

    # ---- decode ----
    def _decoding(self) -> list[Req]:
        # A request whose in-flight tokens certainly end it needs no further step.
        return [r for r in self.running if r.is_decoding and not r.will_finish]

    def decode_needs_retraction(self) -> bool:
        """Would the next decode batch run out of pages? (The overlap scheduler then collects
        the batch in flight first: its finished requests' pages are what retraction lacks.)"""
        # O(1) first: no request can need more than its window's pages plus one partial page
        free = self.kv.num_available
        if len(self.running) * (self.kv.pages_for(self.kv_tokens_per_decode) + 1) <= free:
            return False
        if any(r.needs_extend for r in self.running):
            return False
        need = sum(
            max(0, self.kv.pages_for(r.sched_len + self.kv_tokens_per_decode) - r.num_pages) for r in self._decoding()
        )
        return need > self.kv.num_available

    def _room(self, reqs: list[Req]) -> int:
        """Positions the batch's tightest request has left before the context limit (>= 1: a
        request that reached it is finishing; its step's results are discarded)."""
        limit = self.cfg.max_context_len
        if limit is None:
            return self.kv_tokens_per_decode
        return max(1, min(limit - r.sched_len for r in reqs))

    def _decode_batch(self, on_retract: ReqHook, decoding: list[Req]) -> Batch:
        """Plan the step (the executor's choice for this batch size and the context room left, at
        the top of every decode iteration) and reserve each request's window, retracting the
        newest requests while pages run out; fewer requests may plan otherwise: until it settles."""
        decoding = list(decoding)
        while decoding:
            size = len(decoding)
            plan = self.planner.plan_decode(size, self._room(decoding))
            self._reserve_window(decoding, plan.window, on_retract)
            if len(decoding) == size:  # nobody retracted: the plan holds for this batch
                return Batch.decode(decoding, plan)
        return Batch.idle()

    def _reserve_window(self, decoding: list[Req], window: int, on_retract: ReqHook) -> None:
        """Pages for `window` more tokens per request; the newest requests are retracted (and
        dropped from `decoding`) while the pool runs dry."""
        i, page, limit = 0, self.kv.page_size, self.kv.cfg.max_context_len
        while i < len(decoding):
            req = decoding[i]
            need = req.sched_len + window
            if need <= req.num_pages * page and need <= limit:  # already covered: most steps
                i += 1
                continue
            try:
                self.kv.reserve(req, need)
                i += 1
            except OutOfPages:  # free the newest request and try again
                victim = decoding.pop()
                self.retract(victim, on_retract)
                if victim is req:
                    continue

    def retract(self, req: Req, on_retract: ReqHook) -> None:
        """Give a running request's pages back and requeue it; it re-extends over prompt + output."""
        self.running.remove(req)
        on_retract(req)
        req.state = ReqState.WAITING
        req.num_retractions += 1
        self.waiting.appendleft(req)

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def head_can_never_fit(self) -> bool:
        """True when nothing runs and the first waiting request exceeds the whole pool."""
        if self.running or not self.waiting:
            return False
        need = self.waiting[0].total_len + self.kv_tokens_per_decode
        return self.kv.pages_for(need) > self.kv.allocator.total

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def chunk_len(req: Req, budget: int, chunk_size: int) -> int:
    """Tokens of `req` the next prompt chunk computes within `budget` (0: none this time). A
    retracted request (it has output) never stops one token short of its end: it would then look
    like a decoding request, whose next input its FutureMap row holds, but that row was
    invalidated when it gave its pages back; it stops two short instead (a later chunk of
    `chunk_size` > 1 tokens takes both)."""
    n = min(req.num_uncomputed, max(budget, 0))
    if req.output_ids and n == req.num_uncomputed - 1 and chunk_size > 1:
        n -= 1
    return n
