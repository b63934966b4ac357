"""One attempt of a PD job: the same GenerateRequest to a (prefill, decode) pair (or one colocated
node), the decode stream read with stage timeouts, the prefill's first token relayed, failures
charged (router/blame.py) and aborts sent to both legs. router/dispatch.py retries and picks pairs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from common.defaults import DEFAULT_FIRST_TOKEN_TIMEOUT, DEFAULT_INTER_TOKEN_TIMEOUT, DEFAULT_PREFILL_TIMEOUT
from common.stream_pacer import StreamPacer
from router.contract import (
    DispatchError,
    FinishEvent,
    GenerationJob,
    TokenEvent,
)
from router.blame import LegFailed, prefill_failure, rpc_failure, stage_timeout
from router.metrics import DispatchMetrics
from router.nodes import NodeState
from router.wire import build_request
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


DEFAULT_STAGE_TIMEOUTS = StageTimeouts()


@dataclass(frozen=True)
class AttemptContext:
    """What an attempt needs from its dispatcher: stage timeouts, metrics, a keeper for the
    background tasks (prefill legs, aborts) that outlive the attempt, and the router's stream
    pacer (None: each node paces its own streams)."""

    timeouts: StageTimeouts
    metrics: DispatchMetrics
    keep: Callable[[asyncio.Future[Any]], None]
    stream: StreamPacer | None = None

    def stream_interval(self) -> int:
        """What a new request asks its node for: more than one token a message only while the
        router relays more tokens a second than its message budget (0: the node's own setting)."""
        interval = self.stream.interval_now() if self.stream is not None else 1
        return interval if interval > 1 else 0

    def relayed(self, event: TokenEvent) -> TokenEvent:
        """Count a token event going to a client against the router's message budget."""
        if self.stream is not None:
            self.stream.observe(len(event.token_ids))
        return event


class PDAttempt:
    """One try of one job on one pair, or on one node alone when `prefill` is None: a colocated
    node, or a decode that runs the prompt itself (the local path; no bootstrap is sent, failures
    are the decode's, and there is no prefill token to relay)."""

    def __init__(
        self,
        d: AttemptContext,
        job: GenerationJob,
        prefill: NodeState | None,
        decode: NodeState,
        request_id: str,
        estimate_s: float | None = None,
        cached: int = 0,
    ) -> None:
        """`cached`: the prompt tokens the prompt's node is expected to hold in its prefix cache."""
        self.d, self.job, self.prefill, self.decode, self.rid = d, job, prefill, decode, request_id
        self.estimate_s = estimate_s  # the path decision's TTFT estimate (calibrated) for the prompt's node
        self.room = secrets.randbelow(MAX_ROOM) + 1
        req = build_request(job, request_id, self.room, prefill, d.stream_interval())
        # The prefill's answer carries no logprobs: with logprobs asked for, the decode's copy of
        # the first token (which has them) is the one the client gets.
        self.relay_first = prefill is not None and not (job.sampling.logprobs or job.sampling.top_logprobs)
        self.first_token: int | None = None  # the prefill's token, once its leg succeeded
        self.prefill_cached = 0  # prompt tokens the prefill found in its prefix cache
        self.first_from_prefill = False  # the client's first token came from the prefill's answer
        self._next: asyncio.Future[pb.GenerateResponse] | None = None  # the decode read in flight
        assert decode.stub is not None
        self.call = decode.stub.Generate(req)  # no deadline: a stream may be long; stage timeouts bound it
        self.prefill_task: asyncio.Task[LegFailed | None] | None = None
        if prefill is not None:
            self.prefill_task = asyncio.create_task(self._prefill_leg(req), name=f"prefill-{request_id}")
        decode.inflight += 1
        # The node that computes the prompt holds it as queued work until the first token: the
        # prefill on the remote path, the decode (or colocated node) when it runs the prompt itself.
        self.prompt_node = prefill if prefill is not None else decode
        self.prompt_node.prompts.add(self, len(job.input_ids), time.monotonic(), cached)
        # the calibration the estimate was scaled by: what the rates alone said is estimate / this
        self.estimate_ratio = self.prompt_node.ttft.current(time.monotonic())
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
                    self.prefill_cached = msg.complete.cached_tokens
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
        self._calibrate(self.prefill_done_at)
        return None

    def observe_first_token(self, job_started: float) -> None:
        """TTFT stages of this attempt (router/metrics.py says what each one holds)."""
        self.prompt_node.prompts.settle(self)
        now, stage = time.monotonic(), self.d.metrics.ttft_stage
        if self.prefill is None:
            self._calibrate(now)
        stage.labels("queue").observe(self.started_at - job_started)
        if self.prefill is not None:
            self.d.metrics.first_token_source.labels("prefill" if self.first_from_prefill else "decode").inc()
        if self.prefill_done_at is None:  # colocated, or the decode beat the prefill's answer
            stage.labels("prefill").observe(now - self.started_at)
            return
        stage.labels("prefill").observe(self.prefill_done_at - self.started_at)
        # ~0 when the router relayed the prefill's own token (no wait on the decode)
        stage.labels("first_decode").observe(max(0.0, now - self.prefill_done_at))

    def _calibrate(self, done_at: float) -> None:
        """Teach the prompt's node how long its prompt took against the estimate its path was
        chosen on: until the prefill leg's end (queue, prompt, KV write) on the remote path, until
        the first token on the local one."""
        if self.estimate_s is not None:
            raw = self.estimate_s / self.estimate_ratio  # what the rates alone said
            self.prompt_node.ttft.observe(done_at - self.started_at, raw, done_at)

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
                yield self.d.relayed(relay.prefill_token(self.first_token))
                continue
            spoke = True
            if msg.HasField("chunk"):
                if (event := relay.chunk(msg.chunk)) is not None:
                    yield self.d.relayed(event)
                continue
            done = msg.complete
            if (event := relay.complete(done)) is not None:  # a worker that did not stream (or not all of it)
                yield self.d.relayed(event)
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
                # the prompt ran where its cache was read: on the prefill, or on the decode alone
                self.prefill_cached if self.prefill is not None else done.cached_tokens,
            )
            return

    async def _read(self, deadline: float, budget_s: float, relay_first: bool) -> pb.GenerateResponse | None:
        """The next decode message by `deadline` (loop time), watching the prefill leg meanwhile;
        or None when `relay_first` and the prefill answered with its token first. Raises LegFailed."""
        pt = self.prefill_task
        if self._next is None and not relay_first and (pt is None or pt.done()):
            return await self._read_alone(deadline, budget_s)
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

    async def _read_alone(self, deadline: float, budget_s: float) -> pb.GenerateResponse:
        """The next decode message by `deadline` once nothing else needs watching (most of a
        stream): the read awaited under a timeout, not a task raced against the prefill leg, which
        cost a task and a wait per streamed message on the router's one event loop."""
        try:
            async with asyncio.timeout_at(deadline):
                msg = await self.call.read()  # cancelled (ending the RPC) only as the attempt fails
        except TimeoutError:
            raise await stage_timeout(
                self.prefill, self.decode, False, budget_s, self.d.timeouts.health_timeout
            ) from None
        except grpc.aio.AioRpcError as e:
            raise await self._read_failure(e) from None
        return self._checked(msg)

    async def _message(self, read: asyncio.Future) -> pb.GenerateResponse:
        try:
            msg = read.result()
        except grpc.aio.AioRpcError as e:
            raise await self._read_failure(e) from None
        return self._checked(msg)

    async def _read_failure(self, e: grpc.aio.AioRpcError) -> LegFailed:
        """A failed decode read, blamed on the prefill leg when that failed first (the decode only followed)."""
        pt = self.prefill_task
        if pt is not None and pt.done() and not pt.cancelled() and (failure := pt.result()) is not None:
            return await self._attribute(failure)
        return rpc_failure(e, "decode", self.decode, self.prefill)

    def _checked(self, msg: Any) -> pb.GenerateResponse:
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
        self.prompt_node.prompts.settle(self)
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


__all__ = ["DEFAULT_STAGE_TIMEOUTS", "MAX_ROOM", "AttemptContext", "PDAttempt", "StageTimeouts"]
