"""PDDispatcher: the router's node side (router.contract.Dispatcher).

One job = one or more attempts. An attempt picks a (prefill, decode) pair, invents a random
positive int32 bootstrap room and sends the same GenerateRequest to both legs at once. The client
sees the decode stream; the prefill leg runs in the background and its failure ends the decode
leg. The prefill answers with the first token once its KV write to the decode completed: unless logprobs
are asked for (the prefill's answer carries none), that token goes to the client at once when the
decode has not sent it yet, and the decode's copy is skipped (router/relay.py). Before the first
event an attempt that fails is retried with backoff on a new pair (the failing node excluded) and
a new room; after it, a failure ends the job, so a decode that fails after the prefill's token
went out ends the job with an error. Closing the iterator sends Abort to both legs. With no PD
pair, a colocated node (if any) serves the job alone. Which node a failure is charged to is
router/blame.py's decision.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import AsyncGenerator

import grpc
from prometheus_client import CollectorRegistry
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from common.defaults import DEFAULT_FIRST_TOKEN_TIMEOUT, DEFAULT_INTER_TOKEN_TIMEOUT, DEFAULT_PREFILL_TIMEOUT
from common.sampling import SamplingParams
from router.contract import (
    DispatchError,
    FinishEvent,
    GenerationJob,
    ModelCard,
    TokenEvent,
)
from router.blame import LegFailed, prefill_failure, rpc_failure, stage_timeout
from router.metrics import DispatchMetrics
from router.nodes import NodeRegistry, NodeState, build_request
from router.policy import Policy, pair_available, select_colocated, select_pair
from router.relay import TokenRelay

log = logging.getLogger(__name__)

# The widest room both channels carry: the scheduler API's DisaggregatedParams.bootstrap_room is
# an int32 (SGLang's own 63-bit rooms do not fit it); pdserve's KV control carries a uint64. 0 is
# avoided: it reads as "unset".
MAX_ROOM = 2**31 - 1


@dataclass(frozen=True)
class StageTimeouts:
    """Seconds each stage of an attempt may take; the first three are the router's flags of the same names."""

    prefill_timeout: float = DEFAULT_PREFILL_TIMEOUT  # the whole prefill leg: queue, forward, KV write
    # request sent -> first decode message (prefill + transfer + adoption)
    first_token_timeout: float = DEFAULT_FIRST_TOKEN_TIMEOUT
    inter_token_timeout: float = DEFAULT_INTER_TOKEN_TIMEOUT  # between two decode messages
    abort_timeout: float = 2.0  # the Abort RPCs sent on cancel or failure
    probe_timeout: float = 60.0  # one whole readiness probe
    # a health check asking whose fault a failure is (a stopped node never answers)
    health_timeout: float = 1.0


class _Attempt:
    """One try of one job on one pair (or one colocated node when `prefill` is None)."""

    def __init__(
        self, d: PDDispatcher, job: GenerationJob, prefill: NodeState | None, decode: NodeState, request_id: str
    ) -> None:
        self.d, self.job, self.prefill, self.decode, self.rid = d, job, prefill, decode, request_id
        self.room = secrets.randbelow(MAX_ROOM) + 1
        req = build_request(job, request_id, self.room, prefill)
        # The prefill's answer carries no logprobs: with logprobs asked for, the decode's copy of
        # the first token (which has them) is the one the client gets.
        self.relay_first = prefill is not None and not (job.sampling.logprobs or job.sampling.top_logprobs)
        self.first_token: int | None = None  # the prefill's token, once its leg succeeded
        self.first_from_prefill = False  # the client's first token came from the prefill's answer
        self._next: asyncio.Future[pb.GenerateResponse] | None = None  # the decode read in flight
        assert decode.stub is not None
        self.call = decode.stub.Generate(req)  # no deadline: a stream may be long; stage timeouts bound it
        self.prefill_task: asyncio.Task[LegFailed | None] | None = None
        if prefill is not None:
            self.prefill_task = asyncio.create_task(self._prefill_leg(req), name=f"prefill-{request_id}")
        decode.inflight += 1
        self.blame: set[str] = set()
        self.blame_reason = ""
        self.finished = False
        self.started_at = time.monotonic()
        self.prefill_done_at: float | None = None

    def nodes(self) -> str:
        """The attempt's nodes, for log lines."""
        if self.prefill is None:
            return f"{self.decode.role} node {self.decode.address}"
        return f"prefill node {self.prefill.address} and decode node {self.decode.address}"

    async def _prefill_leg(self, req: pb.GenerateRequest) -> LegFailed | None:
        """Drains the prefill stream, keeping the first token of its GenerateComplete; returns
        (rather than raises) its failure, read by `_read`."""
        assert self.prefill is not None and self.prefill.stub is not None
        self.prefill.inflight += 1  # here, not at creation: a task cancelled unstarted runs no finally
        first: int | None = None
        try:
            async for msg in self.prefill.stub.Generate(req, timeout=self.d.timeouts.prefill_timeout):
                if msg.HasField("complete") and msg.complete.output_ids:
                    first = msg.complete.output_ids[0]
        except grpc.aio.AioRpcError as e:
            return rpc_failure(e, "prefill", self.prefill, self.decode)
        except Exception as e:  # anything else still ends this attempt, not the router
            return LegFailed(
                DispatchError(502, f"prefill leg: {e!r}", code="prefill_failed"), (self.prefill,), "prefill_failed"
            )
        finally:
            self.prefill.inflight -= 1
        # Only a stream that ended well gives its token: its KV write to the decode is complete.
        self.prefill_done_at, self.first_token = time.monotonic(), first
        return None

    def observe_first_token(self, job_started: float) -> None:
        """TTFT stages of this attempt (router/metrics.py says what each one holds)."""
        now, stage = time.monotonic(), self.d.metrics.ttft_stage
        stage.labels("queue").observe(self.started_at - job_started)
        if self.prefill is not None:
            self.d.metrics.first_token_source.labels("prefill" if self.first_from_prefill else "decode").inc()
        if self.prefill_done_at is None:  # colocated, or the decode beat the prefill's answer
            stage.labels("prefill").observe(now - self.started_at)
            return
        stage.labels("prefill").observe(self.prefill_done_at - self.started_at)
        # ~0 when the router relayed the prefill's own token (no wait on the decode)
        stage.labels("first_decode").observe(max(0.0, now - self.prefill_done_at))

    async def events(self) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        t, relay, loop = self.d.timeouts, TokenRelay(self.rid), asyncio.get_running_loop()
        # The decode's first message is due first_token_timeout after the request, whichever leg gave
        # the client its first token; each later one inter_token_timeout after the one before.
        first_by, spoke = loop.time() + t.first_token_timeout, False
        while True:
            budget = t.inter_token_timeout if spoke else t.first_token_timeout
            deadline = loop.time() + budget if spoke else first_by
            msg = await self._read(deadline, budget, self.relay_first and relay.sent == 0)
            if msg is None:  # the prefill answered before the decode streamed a token
                assert self.first_token is not None
                self.first_from_prefill = True
                yield relay.prefill_token(self.first_token)
                continue
            spoke = True
            if msg.HasField("chunk"):
                if (event := relay.chunk(msg.chunk)) is not None:
                    yield event
                continue
            done = msg.complete
            if (event := relay.complete(done)) is not None:  # a worker that did not stream (or not all of it)
                yield event
            matched = (
                done.matched_token_id
                if done.HasField("matched_token_id")
                else done.matched_stop_str
                if done.HasField("matched_stop_str")
                else None
            )
            self.finished = True
            yield FinishEvent(
                done.finish_reason or "stop",
                done.prompt_tokens,
                done.completion_tokens or len(done.output_ids),
                matched,
                self.prefill is not None,
            )
            return

    async def _read(self, deadline: float, budget_s: float, relay_first: bool) -> pb.GenerateResponse | None:
        """The next decode message by `deadline` (loop time), watching the prefill leg meanwhile;
        or None when `relay_first` and the prefill answered with its token first. Raises LegFailed."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.call.read())
        read, loop = self._next, asyncio.get_running_loop()
        try:
            while True:
                if relay_first and self.first_token is not None:
                    return None  # the read stays pending for the next call: cancelling it ends the RPC
                pt = self.prefill_task
                waiting: set[asyncio.Future] = {read} if pt is None or pt.done() else {read, pt}
                done, _ = await asyncio.wait(
                    waiting, timeout=max(deadline - loop.time(), 0.0), return_when=asyncio.FIRST_COMPLETED
                )
                if read in done:
                    self._next = None
                    return await self._message(read)
                if not done:
                    raise await stage_timeout(
                        self.prefill,
                        self.decode,
                        pt is not None and not pt.done(),
                        budget_s,
                        self.d.timeouts.health_timeout,
                    )
                if (failure := pt.result()) is not None:  # type: ignore[union-attr]
                    raise await self._attribute(failure)
        except BaseException:
            self._drop_read()  # the attempt is over either way
            raise

    def _drop_read(self) -> None:
        """Let go of the decode read in flight; cancelling it cancels the decode RPC too."""
        read, self._next = self._next, None
        if read is None:
            return
        if not read.done():
            read.cancel()
        elif not read.cancelled():
            read.exception()  # marks an error as seen: asyncio would log it as never retrieved

    async def _message(self, read: asyncio.Future) -> pb.GenerateResponse:
        try:
            msg = read.result()
        except grpc.aio.AioRpcError as e:
            pt = self.prefill_task
            if pt is not None and pt.done() and not pt.cancelled() and (failure := pt.result()) is not None:
                raise await self._attribute(failure) from None  # the decode only followed
            raise rpc_failure(e, "decode", self.decode, self.prefill) from None
        if msg is grpc.aio.EOF:
            raise LegFailed(
                DispatchError(
                    502,
                    f"decode node {self.decode.address} ended its stream without GenerateComplete",
                    code="decode_failed",
                ),
                (self.decode,),
                "decode_failed",
            )
        return msg

    async def _attribute(self, failure: LegFailed) -> LegFailed:
        return await prefill_failure(failure, self.decode, self.d.timeouts.health_timeout)

    async def close(self, reason: str) -> None:
        """End the attempt: on failure or cancel stop both legs and Abort them; give verdicts."""
        self.decode.inflight -= 1
        if not self.finished:
            self._drop_read()  # pending when the job ended right after the prefill's token
            self.call.cancel()
            if self.prefill_task is not None:
                self.prefill_task.cancel()
        self._verdict(self.decode, self.finished)
        if self.prefill_task is not None:
            self.prefill_task.add_done_callback(self._prefill_verdict)
            self.d.keep(self.prefill_task)  # may outlive a finished decode stream by a moment
        if self.finished:
            return
        stubs = [stub for n in (self.prefill, self.decode) if n is not None and (stub := n.stub) is not None]
        request = pb.AbortRequest(request_id=self.rid, reason=reason)
        aborts = [stub.Abort(request, timeout=self.d.timeouts.abort_timeout) for stub in stubs]
        task = asyncio.ensure_future(asyncio.gather(*aborts, return_exceptions=True))
        try:  # shielded: a second cancel of the consumer must not drop the aborts
            await asyncio.wait_for(asyncio.shield(task), self.d.timeouts.abort_timeout)
        except asyncio.TimeoutError:
            self.d.keep(task)
        except asyncio.CancelledError:
            self.d.keep(task)
            raise

    def _prefill_verdict(self, task: asyncio.Task) -> None:
        ok = not task.cancelled() and task.exception() is None and task.result() is None
        assert self.prefill is not None
        self._verdict(self.prefill, ok)

    def _verdict(self, node: NodeState, ok: bool) -> None:
        if node.address in self.blame:
            node.breaker.record_failure()
            self.d.metrics.node_failures.labels(node.address, node.role, self.blame_reason).inc()
        elif ok:
            node.breaker.record_success()
        else:  # cancelled, or the other leg's fault: no verdict on this node
            node.breaker.release()
        self.d.metrics.observe_nodes([node])


class PDDispatcher:
    def __init__(
        self,
        registry: NodeRegistry,
        prefill_policy: Policy,
        decode_policy: Policy,
        *,
        max_attempts: int = 3,
        timeouts: StageTimeouts = StageTimeouts(),
        backoff_s: float = 0.05,
        backoff_max_s: float = 1.0,
        ready_window_s: float = 60.0,
        probe_interval_s: float = 5.0,
        probe_input_ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
        auto_probe: bool = True,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry, self.prefill_policy, self.decode_policy = registry, prefill_policy, decode_policy
        self.max_attempts, self.timeouts = max(1, max_attempts), timeouts
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.ready_window_s, self.probe_interval_s, self.probe_input_ids = (
            ready_window_s,
            probe_interval_s,
            probe_input_ids,
        )
        # Its own registry unless given one: /metrics must expose it (or pass the HTTP side's registry).
        self.metrics_registry = metrics_registry if metrics_registry is not None else CollectorRegistry()
        self.metrics = DispatchMetrics(self.metrics_registry)
        self.metrics.ready.set_function(lambda: float(self.ready()))
        self._last_success: float | None = None
        self._last_probe = -float("inf")
        self._probe_task: asyncio.Task[bool] | None = None
        self._background: set[asyncio.Future] = set()
        if auto_probe:
            registry.listeners.append(self._on_refresh)

    def model(self) -> ModelCard | None:
        return self.registry.model_card()

    def ready(self) -> bool:
        """A handoff succeeded lately AND a healthy compatible pair (or colocated node) is there now:
        a recent success alone would keep a router with every decode dead "ready" for the window."""
        recent = self._last_success is not None and time.monotonic() - self._last_success <= self.ready_window_s
        return recent and pair_available(self.registry)

    async def generate(self, job: GenerationJob) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        job_started = time.monotonic()
        blamed: set[str] = set()  # never again for this job
        tried: set[str] = set()  # avoided when another choice exists
        last: LegFailed | None = None
        for n in range(self.max_attempts):
            if last is not None:
                self.metrics.retries.labels(last.reason).inc()
                await asyncio.sleep(min(self.backoff_max_s, self.backoff_s * 2 ** (n - 1)) * random.uniform(0.5, 1.0))
            target = self._pick(job, blamed | tried) or self._pick(job, blamed)
            if target is None:
                if last is not None:
                    raise last.error
                raise DispatchError(
                    503,
                    "no healthy compatible prefill/decode pair (or colocated node) is available",
                    code="no_available_pair",
                    retry_after_s=1.0,
                )
            prefill, decode = target
            self.metrics.pairs.labels(prefill.address if prefill else "-", decode.address).inc()
            attempt = _Attempt(self, job, prefill, decode, job.request_id if n == 0 else f"{job.request_id}-retry{n}")
            events = attempt.events()
            started, reason = False, "client cancelled"
            try:
                async for event in events:
                    if not started and isinstance(event, TokenEvent):
                        attempt.observe_first_token(job_started)
                    started = True
                    if isinstance(event, FinishEvent) and event.finish_reason != "abort":
                        self._last_success = time.monotonic()  # before the yield: the consumer may stop here
                    yield event
                return
            except LegFailed as f:
                attempt.blame, attempt.blame_reason = {node.address for node in f.blame}, f.reason
                reason = f"{f.reason}: {f.error.message}"
                if started:  # the client has part of the answer: no retry, and one line saying why
                    f.error.before_first_token = False
                    log.warning("request %s failed mid-stream on %s: %s", attempt.rid, attempt.nodes(), reason)
                    raise f.error from None
                if not f.retryable:
                    raise f.error from None
                log.warning(
                    "attempt %d/%d of %s failed before the first token: %s",
                    n + 1,
                    self.max_attempts,
                    job.request_id,
                    f.error,
                )
                blamed |= attempt.blame
                tried |= {node.address for node in (prefill, decode) if node is not None}
                last = f
            finally:
                await events.aclose()
                await attempt.close(reason)
        assert last is not None
        raise last.error

    def _pick(self, job: GenerationJob, exclude: set[str]) -> tuple[NodeState | None, NodeState] | None:
        """A PD pair if any; else a colocated node; breaker slots are claimed here."""
        for _ in range(4):  # a half-open probe slot taken meanwhile: choose again
            pair = select_pair(self.registry, self.prefill_policy, self.decode_policy, job, exclude)
            if pair is not None:
                prefill, decode = pair
                if prefill.breaker.acquire():
                    if decode.breaker.acquire():
                        return prefill, decode
                    prefill.breaker.release()
                continue
            node = select_colocated(self.registry, self.decode_policy, job, exclude)
            if node is None:
                return None
            if node.breaker.acquire():
                return None, node
        return None

    async def probe(self) -> bool:
        """One tiny real request (one token) through a pair, so readiness needs no user traffic."""
        self._last_probe = time.monotonic()
        job = GenerationJob(
            f"probe-{uuid.uuid4().hex[:16]}", self.probe_input_ids, SamplingParams(max_new_tokens=1, temperature=0.0)
        )
        try:
            async with asyncio.timeout(self.timeouts.probe_timeout):
                async for _ in self.generate(job):
                    pass
        except (DispatchError, TimeoutError) as e:
            log.warning("readiness probe failed: %s", e or "timed out")
            return False
        return True

    def _on_refresh(self) -> None:
        """Registry refresh hook: publish node gauges; re-probe when no request succeeded lately."""
        self.metrics.sync_nodes(self.registry.states)
        now = time.monotonic()
        stale = self._last_success is None or now - self._last_success > self.ready_window_s / 2
        if (
            stale
            and (self._probe_task is None or self._probe_task.done())
            and now - self._last_probe >= self.probe_interval_s
            and pair_available(self.registry)
        ):
            self._probe_task = asyncio.create_task(self.probe(), name="readiness-probe")

    def keep(self, task: asyncio.Future) -> None:
        """Hold a reference to a background task until it ends (asyncio keeps only weak ones)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Stop background work (probe, leftover prefill legs and aborts) and the refresh hook."""
        if self._on_refresh in self.registry.listeners:
            self.registry.listeners.remove(self._on_refresh)
        pending = [t for t in [self._probe_task, *self._background] if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
