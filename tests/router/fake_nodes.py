"""Fake in-process SglangScheduler nodes for router tests: a prefill that completes with one token
once its decode took the room, a decode (or colocated node) that streams scripted tokens, with
switches for failures and hangs and the loads and measured rates they report. Every RPC is
recorded (Generate requests, Aborts, streams the client cancelled). Also the small async helpers
the dispatch tests share (run, job, dispatcher, collect, until)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pbg
from smg_grpc_proto.generated import common_pb2 as cpb

from common.sampling import SamplingParams
from router.contract import FinishEvent, GenerationJob, TokenEvent
from router.dispatch import PDDispatcher, StageTimeouts
from router.nodes import NodeRegistry, NodeSpec
from router.policy import make_policy

MODES = {"prefill": "prefill", "decode": "decode", "colocated": "null"}
HANG_S = 3600.0  # "forever": servers are stopped (which cancels the RPC) long before
# Bootstrap rooms a fake decode has taken (in a real pair: reserved KV and sent its destination).
# A fake prefill answers only once its room is here, as a real one writes KV only to a decode that
# reserved it; so a decode failing (or hanging) before its first token fails before the handoff.
_TAKEN: dict[int, asyncio.Event] = {}


def _room(room: int) -> asyncio.Event:
    return _TAKEN.setdefault(room, asyncio.Event())


@dataclass
class Behaviour:
    tokens: tuple[int, ...] = (11, 12, 13)
    fail_before_first: bool = False
    fail_after: int | None = None  # tokens streamed before failing
    hang_before_first: bool = False
    hang_after: int | None = None  # tokens streamed before hanging
    status: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    pairing_protocol: str | None = "pp-A"
    mode: str | None = None  # GetServerInfo's disaggregation_mode; None: the role's own
    healthy: bool = True
    silent: bool = False  # HealthCheck never answers (a stopped process)
    blame: str | None = None  # a failure names this role at fault (trailing metadata, as nodes do)
    hold_first: asyncio.Event | None = None  # the first message waits for this (a prefill's: after its handoff)
    chunks: bool = True  # a decode streams chunks; False: only its GenerateComplete, with every token
    running: int = 0
    waiting: int = 0
    # What nodes report for the prefill path decision; None: the key is absent (an older node).
    perf: dict[str, Any] | None = None  # GetServerInfo's server_args["perf"]
    local_prefill: bool | None = None  # server_args["local_prefill"] (decode nodes)
    local_decode: bool | None = None  # server_args["local_decode"] (prefill nodes)
    waiting_prompt_tokens: int = 0  # GetLoads' num_waiting_uncached_tokens
    used_tokens: int = 0
    max_tokens: int = 0
    kv_transfer_ms: float = 0.0  # GetLoads' disaggregation.kv_transfer_latency_ms


class FakeNode(pbg.SglangSchedulerServicer):
    def __init__(self, role: str, behaviour: Behaviour | None = None, bootstrap_port: int = 9100) -> None:
        self.role, self.b, self.bootstrap_port = role, behaviour or Behaviour(), bootstrap_port
        self.requests: list[pb.GenerateRequest] = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []  # Generate streams that ended because the client went away
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def spec(self) -> NodeSpec:
        return NodeSpec(self.role, self.address, self.bootstrap_port if self.role == "prefill" else None)

    async def start(self) -> FakeNode:
        self.server = grpc.aio.server()
        pbg.add_SglangSchedulerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        rid, b = request.request_id, self.b
        n_prompt = len(request.tokenized.input_ids)
        tokens = list(b.tokens[: request.sampling_params.max_new_tokens or len(b.tokens)])
        try:
            if b.hang_before_first:
                await asyncio.sleep(HANG_S)
            if b.fail_before_first:
                await context.abort(
                    b.status,
                    f"fake {self.role} failed before its first token",
                    trailing_metadata=(("pdserve-blame", b.blame),) if b.blame else (),
                )
            # a prefill sent a request alone (the whole path) streams it as a decode does
            if self.role == "prefill" and request.HasField("disaggregated_params"):
                await self._handoff(request.disaggregated_params.bootstrap_room)
                if b.hold_first is not None:
                    await b.hold_first.wait()
                yield pb.GenerateResponse(
                    request_id=rid,
                    complete=pb.GenerateComplete(
                        output_ids=tokens[:1], finish_reason="length", prompt_tokens=n_prompt, completion_tokens=1
                    ),
                )
                return
            if request.HasField("disaggregated_params"):
                _room(request.disaggregated_params.bootstrap_room).set()
            if b.hold_first is not None:
                await b.hold_first.wait()
            for i, t in enumerate(tokens if b.chunks else ()):
                if b.fail_after == i:
                    await context.abort(b.status, f"fake {self.role} failed mid-stream")
                if b.hang_after == i:
                    await asyncio.sleep(HANG_S)
                lp = (
                    pb.OutputLogProbs(
                        token_logprobs=[-0.5],
                        token_ids=[t],
                        top_logprobs=[pb.TopLogProbs(token_ids=[t], values=[-0.5])],
                    )
                    if request.return_logprob
                    else None
                )
                yield pb.GenerateResponse(
                    request_id=rid,
                    chunk=pb.GenerateStreamChunk(
                        token_ids=[t], prompt_tokens=n_prompt, completion_tokens=i + 1, output_logprobs=lp
                    ),
                )
            yield pb.GenerateResponse(
                request_id=rid,
                complete=pb.GenerateComplete(
                    output_ids=tokens, finish_reason="length", prompt_tokens=n_prompt, completion_tokens=len(tokens)
                ),
            )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise

    async def _handoff(self, room: int) -> None:
        """The prefill's "KV write": done once its decode took the room."""
        try:
            await _room(room).wait()
        finally:
            _TAKEN.pop(room, None)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.aborts.append(request.request_id)
        return pb.AbortResponse(success=True)

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        if self.b.silent:
            await asyncio.sleep(HANG_S)
        return pb.HealthCheckResponse(healthy=self.b.healthy, message="ok" if self.b.healthy else "sick")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            served_model_name="fake-model",
            model_path="/models/fake",
            tokenizer_path="/models/fake",
            max_context_length=256,
            eos_token_ids=[2],
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        args = struct_pb2.Struct()
        args.update({"disaggregation_mode": self.b.mode or MODES[self.role]})
        if self.b.pairing_protocol is not None:
            args.update({"pairing_protocol": self.b.pairing_protocol})
        if self.b.perf is not None:
            args.update({"perf": self.b.perf})
        if self.b.local_prefill is not None:
            args.update({"local_prefill": self.b.local_prefill})
        if self.b.local_decode is not None:
            args.update({"local_decode": self.b.local_decode})
        return pb.GetServerInfoResponse(server_args=args, server_type="grpc")

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        b = self.b
        load = pb.SchedulerLoad(
            num_running_reqs=b.running,
            num_waiting_reqs=b.waiting,
            num_used_tokens=b.used_tokens,
            max_total_num_tokens=b.max_tokens,
            num_waiting_uncached_tokens=b.waiting_prompt_tokens,
        )
        if b.kv_transfer_ms:
            load.disaggregation.CopyFrom(pb.DisaggregationMetrics(kv_transfer_latency_ms=b.kv_transfer_ms))
        return pb.GetLoadsResponse(loads=[load])

    async def SubscribeKvEvents(self, request: cpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext) -> None:
        # What an engine without a prefix cache answers: the router stops asking for a while.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node publishes no KV events")


@contextlib.asynccontextmanager
async def cluster(*nodes: FakeNode, refresh: bool = True) -> AsyncIterator[NodeRegistry]:
    """Start the nodes, build a registry over them (refreshed once), stop everything at the end."""
    registry: NodeRegistry | None = None
    try:
        for n in nodes:
            await n.start()
        registry = NodeRegistry([n.spec for n in nodes], rpc_timeout_s=2.0)
        if refresh:
            await registry.refresh_once()
        yield registry
    finally:
        if registry is not None:
            await registry.stop()
        await asyncio.gather(*(n.stop() for n in nodes))


# --- test helpers -----------------------------------------------------------------------------

FAST = StageTimeouts(
    prefill_timeout=5.0, first_token_timeout=5.0, inter_token_timeout=5.0, abort_timeout=2.0, probe_timeout=10.0
)


def run(coro: Awaitable[Any], timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def job(rid: str = "req-1", ids: tuple[int, ...] = (5, 6, 7, 8), **sampling: Any) -> GenerationJob:
    return GenerationJob(rid, ids, SamplingParams(**{"max_new_tokens": 3, **sampling}))


def dispatcher(registry: Any, decode: str = "least_load", prefill: str = "round_robin", **kw: Any) -> PDDispatcher:
    kw = {"timeouts": FAST, "backoff_s": 0.01, "auto_probe": False, **kw}
    return PDDispatcher(registry, make_policy("prefill", prefill), make_policy("decode", decode), **kw)


async def collect(d: PDDispatcher, j: GenerationJob) -> list[TokenEvent | FinishEvent]:
    return [e async for e in d.generate(j)]


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
