"""The scheduling loop: Scheduler(policy, executor, io, config) with continuous batching and stop checks.

Overlap mode (`overlap=True` and an executor that supports it): each iteration forms and launches
batch N+1 from what the host knows, then collects batch N, so the CPU work of one batch hides
behind the device work of the previous one. Results arrive one iteration late: a request that
finishes in batch N may already run in batch N+1, whose results for it are discarded, and its
pages, slot and FutureMap row go back only after batch N+1 was collected (`Req.inflight`).

Grammar masks are built on the host from matchers that must hold every earlier token. When the
batch in flight samples for a constrained request, the next batch carries `Batch.settle`, which
collects it: an executor that settles grammars in its launch calls it once the forward is enqueued
and before it reads a matcher (the collect hides behind device work); with any other, that batch
is collected before the next is formed. Either way no mask is built from stale state.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from engine.algorithm import EngineAlgorithm, PlainDecoding, slot_future_map
from engine.core import Batch, FinishReason, ForwardMode, Req, ReqState, StepOutput
from engine.executor import Executor
from engine.future_map import DraftInput, FutureMap
from engine.device_event import DeviceEvent
from engine.scheduler.inflight import Launched, mark_launched, samples_grammar, unmark_launched
from engine.scheduler.kv_progress import KVProgress, needs_fence, record_fence
from engine.scheduler.policy import BatchPolicy
from engine.scheduler.stops import StopRules
from engine.scheduler.rates import NodeRates
from engine.scheduler.stats import CACHED_TOKEN_BUCKETS, COUNTERS, BatchTimes, DurationHistogram
from engine.scheduler.updates import RequestUpdate, SchedulerIO, final_update, step_update


log = logging.getLogger(__name__)
# Steps a member of a failed batch runs alone: its (re)prefill and a decode step, the two places
# a request-specific failure shows.
SOLO_STEPS = 2


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's own settings: the model's end-of-sequence ids and context length (its stop
    rules), overlap scheduling (run only where the executor supports it), FutureMap debug mode."""

    eos_token_ids: tuple[int, ...]
    max_context_len: int
    overlap: bool = False
    future_map_debug: bool = False


class Scheduler:
    """One iteration: take input, form a batch, run it, apply stop rules, publish updates."""

    def __init__(
        self,
        policy: BatchPolicy,
        executor: Executor,
        io: SchedulerIO,
        config: SchedulerConfig,
        algorithm: EngineAlgorithm | None = None,
        rates: NodeRates | None = None,
    ) -> None:
        """`algorithm` builds the FutureMap (plain decoding's when None); the KV pool is the
        policy's; `rates` receives every batch's timing (the policy's TPOT guard may read it)."""
        self.policy, self.executor, self.io, self.kv = policy, executor, io, policy.kv
        self.rates = rates if rates is not None else NodeRates()
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.max_context_len = config.max_context_len
        self.stops = StopRules(self.eos_token_ids, self.max_context_len)
        self.future_map = self._init_overlap(algorithm or PlainDecoding(), config.overlap, config.future_map_debug)
        self.reqs: dict[str, Req] = {}
        self._inflight: Launched | None = None
        self._settled: list[RequestUpdate] = []  # collected inside a launch (`_settle_inflight`)
        self.stats = dict.fromkeys(COUNTERS, 0)
        self.cached_per_request = DurationHistogram(CACHED_TOKEN_BUCKETS)  # tokens, not seconds
        self.queue_time = DurationHistogram()  # waiting -> admitted, per admission (node metrics)
        self.prompt_time = DurationHistogram()  # first admission -> first token (node metrics)
        self.launch_time = BatchTimes()  # host time per batch launch (node metrics)

    def _init_overlap(self, algorithm: EngineAlgorithm, overlap: bool, debug: bool) -> FutureMap:
        """The relay every launch reads its unknown-on-the-host inputs from, built by the algorithm
        (plain decoding too: its next input tokens travel the same way), bound to the executor.
        Overlap runs only when the executor can run one batch ahead; never by algorithm name."""
        self.overlap = overlap and self.executor.supports_overlap()
        cfg, table = self.policy.cfg, self.kv.req_to_token
        future_map = slot_future_map(
            algorithm,
            cfg.max_running,
            cfg.chunked_prefill_size,
            self.max_context_len,
            table.shape[0],
            table.device,
            debug,
        )
        self.executor.bind_future_map(future_map)
        return future_map

    # ---- input ----
    def _ingest(self) -> list[RequestUpdate]:
        new, aborts = self.io.poll()
        for req in new:
            if req.rid in self.reqs:
                req.finish(FinishReason.ABORT, f"duplicate request id {req.rid!r}")
                self.io.publish([final_update(req)])
                continue
            self.reqs[req.rid] = req
            req.queued_at = time.monotonic()
            self.policy.add(req)
        return [self._abort(rid) for rid in aborts if rid in self.reqs]

    def adopt_prebuilt(
        self, reqs: list[Req], draft_input: DraftInput, first: StepOutput | None = None
    ) -> list[RequestUpdate]:
        """PD decode: requests whose prompt KV and first token arrived from a prefill node join the
        running batch. Each already holds a slot and pages covering `seq_len` (= prompt length)
        and has `output_ids == [first token]`; the executor seeds their FutureMap rows from the
        algorithm's `draft_input`, and the first token (with its logprobs in `first`, if any)
        goes through the stop rules."""
        for req in reqs:
            assert req.slot and req.seq_len == len(req.prompt_ids) and len(req.output_ids) == 1, req.rid
            req.state = ReqState.RUNNING
            self.reqs[req.rid] = req
            self.policy.running.append(req)
            self.executor.on_admit(req)
        self.executor.adopt_prebuilt(reqs, draft_input, self.future_map.batch([r.slot for r in reqs]))
        out = first or StepOutput(tokens=[[r.output_ids[0]] for r in reqs])
        updates = []
        for i, req in enumerate(reqs):
            updates.append(self._append(req, [req.output_ids.pop()], out, i))
        return [u for u in updates if u is not None]

    def fail(self, req: Req, detail: str) -> RequestUpdate:
        """End a request now with an error (e.g. a handoff that cannot seed decoding)."""
        req.finish(FinishReason.ABORT, detail)
        return self._finish(req)

    def _abort(self, rid: str, detail: str = "aborted") -> RequestUpdate:
        req = self.reqs[rid]
        req.finish(FinishReason.ABORT, detail)
        return self._finish(req)

    # ---- one iteration ----
    def step(self) -> list[RequestUpdate]:
        updates = self._ingest()
        if self.policy.head_can_never_fit():
            req = self.policy.waiting[0]
            req.finish(FinishReason.ABORT, f"request needs more KV than the whole pool ({req.total_len} tokens)")
            updates.append(self._finish(req))
        grammar = self._inflight is not None and samples_grammar(self._inflight.batch)
        late = grammar and self.executor.settles_grammar_in_launch()
        if self._inflight is not None and (self.policy.decode_needs_retraction() or (grammar and not late)):
            # finished requests of the batch in flight hold the pages retraction would miss; a
            # constrained request's next mask needs the tokens the batch in flight samples
            self.stats["overlap_syncs"] += 1
            updates.extend(self._collect_inflight())
        batch = self.policy.next_batch(self._on_admit, self._on_retract)
        if batch.mode is not ForwardMode.IDLE:
            if late and self._inflight is not None:
                batch.settle = self._settle_inflight
            updates.extend(self._run(batch))
        elif self._inflight is not None:
            updates.extend(self._collect_inflight())
        if updates:
            self.io.publish(updates)
        return updates

    def _run(self, batch: Batch) -> list[RequestUpdate]:
        mark_launched(batch)
        self.stats["steps"] += 1
        relay = self.future_map.batch([r.slot for r in batch.reqs])
        device = self.kv.req_to_token.device
        t0 = time.perf_counter()
        if not self.overlap:
            try:
                out = self.executor.step(batch, relay)
            except Exception as e:  # noqa: BLE001 - isolated below: only its cause fails
                self._abandon(batch)
                return self._isolate(batch, e)
            self.launch_time.observe(batch.mode, time.perf_counter() - t0)
            self.rates.batch_done(batch, out, t0)
            updates = self._complete(batch, out)
            if needs_fence(batch):
                updates += self._chunk_progress(batch, record_fence(device))
            return updates
        try:
            handle = self.executor.launch(batch, relay)
        except Exception as e:  # noqa: BLE001 - isolated below: only its cause fails
            self._abandon(batch)
            return self._isolate(batch, e) + self._take_settled() + self._collect_inflight()
        finally:
            batch.settle = None  # the batch it collected is gone: a replay of this one settles nothing
        launch_s = time.perf_counter() - t0
        self.launch_time.observe(batch.mode, launch_s)
        if needs_fence(batch):  # before the next launch
            # Published now, not when the batch is collected: that happens only after the next
            # chunk's launch, which on a launch-bound prompt is about when that chunk is done,
            # so the last chunk's pages would leave only as the prompt ends.
            self.io.publish(self._chunk_progress(batch, record_fence(device)))
        updates = self._take_settled() + self._collect_inflight()
        self._inflight = Launched(batch, handle, t0, launch_s)
        return updates

    def _settle_inflight(self) -> None:
        """`Batch.settle`: collect the batch in flight from inside the next one's launch; its
        updates go out with the launch's (`_take_settled`)."""
        self.stats["grammar_settles"] += 1
        self._settled.extend(self._collect_inflight())

    def _take_settled(self) -> list[RequestUpdate]:
        settled, self._settled = self._settled, []
        return settled

    def _chunk_progress(self, batch: Batch, fence: DeviceEvent) -> list[RequestUpdate]:
        """A prompt chunk was launched (or, without overlap, computed): the pages its requests'
        launched chunks fill hold final KV once `fence` is reached (a failure or retraction
        meanwhile publishes a restart)."""
        ps = self.kv.page_size
        return [
            RequestUpdate(r.rid, [], kv_progress=KVProgress(tuple(self.kv.page_list(r)[: r.sched_len // ps]), fence))
            for r, s in zip(batch.reqs, batch.sample)
            if r.hold_kv and not s
        ]

    def _collect_inflight(self) -> list[RequestUpdate]:
        launched, self._inflight = self._inflight, None
        if launched is None:
            return []
        try:
            out = self.executor.collect(launched.handle)
        except Exception as e:  # noqa: BLE001 - isolated below: only its cause fails
            self._abandon(launched.batch)
            return self._isolate(launched.batch, e)
        self.rates.batch_done(launched.batch, out, launched.at, launched.launch_s)
        return self._complete(launched.batch, out)  # its KV progress went out at launch

    def _isolate(self, batch: Batch, err: Exception) -> list[RequestUpdate]:
        """A step failed. A request alone in its batch is the cause: it fails, and only it. In
        a batch of several, each member is retracted and re-runs alone for a few steps (its KV
        recomputed from its tokens: exact), so the cause fails by itself and the rest go on."""
        live = [r for r, e in zip(batch.reqs, batch.epochs) if not r.finished and r.epoch == e]
        detail = f"internal error: {type(err).__name__}: {err}"
        log.error("%s step of %d request(s) failed: %s", batch.mode.name, len(batch.reqs), detail, exc_info=err)
        self.stats["failed_steps"] += 1
        if len(batch.reqs) == 1:
            return [self.fail(r, detail) for r in live]
        for req in live:
            req.solo = SOLO_STEPS
            if req in self.policy.running:
                self.policy.retract(req, self._on_retract)
        return []

    def flush(self) -> list[RequestUpdate]:
        """Collect the batch in flight (if any) and publish what it produced."""
        updates = self._collect_inflight()
        if updates:
            self.io.publish(updates)
        return updates

    @property
    def has_work(self) -> bool:
        return self.policy.has_work or self._inflight is not None

    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        while not stop.is_set():
            self.step()
            if not self.has_work:
                self.io.wait_for_work(idle_wait)

    def fail_all(self, detail: str) -> list[RequestUpdate]:
        """After a failed step: drop the batch in flight and end every request with an error."""
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._abandon(launched.batch)
        updates = []
        for req in list(self.reqs.values()):
            req.finish(FinishReason.ABORT, detail)
            updates.append(self._finish(req))
        return updates

    def _on_admit(self, req: Req) -> None:
        now = time.monotonic()
        self.queue_time.observe(now - req.queued_at)
        if not req.admitted_at:  # the first admission: what its prompt found in the prefix cache
            req.admitted_at = now
            self.stats["admitted_prompt_tokens"] += len(req.prompt_ids)
            self.stats["cached_prompt_tokens"] += req.cached_tokens
            self.cached_per_request.observe(req.cached_tokens)
        self.executor.on_admit(req)

    def _on_retract(self, req: Req) -> None:
        self.stats["retractions"] += 1
        req.queued_at = time.monotonic()  # back in the queue: its next wait is counted from now
        req.epoch += 1  # what the batch in flight computes for it is recomputed after re-admission
        if req.hold_kv:  # pages reported final are gone: whoever ships them starts over
            self.io.publish(
                [RequestUpdate(req.rid, [], kv_progress=KVProgress((), record_fence(self.kv.req_to_token.device)))]
            )
        self._release(req)

    # ---- in-flight bookkeeping ----
    def _abandon(self, batch: Batch) -> None:
        """A batch whose results will never be processed (its step failed)."""
        for i, req in enumerate(batch.reqs):
            unmark_launched(batch, i)
            if req.release_pending and not req.inflight:
                self._release(req)

    def _release(self, req: Req) -> None:
        """Pages, slot and the executor's per-slot state go back once no forward uses them."""
        if not req.slot:
            return
        if req.inflight:
            req.release_pending = True
            return
        req.release_pending = False
        cacheable = self.executor.cacheable_tokens(req)  # before the executor forgets the request
        self.executor.on_release(req)
        self.future_map.invalidate(torch.tensor([req.slot], dtype=torch.int64))
        self.kv.release(req, cacheable)

    # ---- output ----
    def _complete(self, batch: Batch, out: StepOutput) -> list[RequestUpdate]:
        updates, decoded = [], 0
        # unmark_launched inlined: this loop runs once per request per step on the host's critical path
        extend = batch.mode is ForwardMode.EXTEND or batch.mode is ForwardMode.MIXED
        window, first_prompt = batch.window, batch.decode_rows  # a MIXED batch's decode rows come first
        for i, (req, n, s, epoch) in enumerate(zip(batch.reqs, batch.extend_lens, batch.sample, batch.epochs)):
            req.inflight -= 1
            req.inflight_len -= n if extend else window
            req.inflight_samples -= int(s)
            if req.finished or req.epoch != epoch:
                # aborted, finished by an earlier batch, or retracted while this one ran
                self.stats["discarded"] += 1
                if req.release_pending and not req.inflight:
                    self._release(req)
                continue
            new = out.tokens[i]
            if req.solo:
                req.solo -= 1  # one more step it ran without failing
            # KV of the computed window is committed; under speculation len(new) = accepted + 1
            prompt_done = False
            if extend and i >= first_prompt:
                req.seq_len += n
                self.stats["prefill_tokens"] += n
                if new and not req.output_ids:  # the prompt's last chunk: its first token
                    self.prompt_time.observe(time.monotonic() - req.admitted_at)
                    prompt_done = True
            else:
                req.seq_len += len(new)
                decoded += len(new)
            upd = self._append(req, new, out, i)
            if upd is not None:
                updates.append(upd)
            if prompt_done and not req.finished:  # others sharing its prefix may read it from now on
                self.kv.share_prefix(req, self.executor.cacheable_tokens(req))
        self.stats["decode_tokens"] += decoded
        if batch.mode is ForwardMode.MIXED:
            self.stats["mixed_steps"] += 1
        return updates

    def _append(self, req: Req, new: list[int], out: StepOutput, i: int) -> RequestUpdate | None:
        if not new:
            return None
        upd = step_update(req, self.stops.append(req, new), out, i)
        if req.finished:
            done = self._finish(req)
            # held_pages too: without them whoever ships a held request's KV asks the scheduler
            # thread for its pages, a round trip that waits for the step in flight
            upd.finished, upd.finish_reason, upd.held_pages = True, done.finish_reason, done.held_pages
        return upd

    def _finish(self, req: Req) -> RequestUpdate:
        """Release everything a finished request holds and drop it from the scheduler."""
        self.policy.remove(req)
        req.epoch += 1
        if req.slot and not (req.hold_kv and req.finish_reason is not FinishReason.ABORT):
            self._release(req)
        req.state = ReqState.FINISHED
        self.reqs.pop(req.rid, None)
        upd = final_update(req)
        if req.hold_kv and req.slot and req.finish_reason is not FinishReason.ABORT:
            upd.held_pages = tuple(self.kv.page_list(req))  # whoever ships them needs no round trip
        return upd

    def release_kv(self, req: Req) -> None:
        """Return a request's pages and slot (also for held requests once their transfer ends);
        deferred while a forward in flight still uses them."""
        self._release(req)
