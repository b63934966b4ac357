"""SglangScheduler servicer shared by every node role; Generate is delegated to a role handler."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from common.logs import bind_request_id
from engine.core import InvalidRequest
from engine.service.health import HealthWatch, leaked_capacity
from engine.service.kv_events import KvEventLog, subscribe
from engine.service.stream import RequestFailed
from engine.loop import EngineLoop

log = logging.getLogger(__name__)
# trailing metadata naming the role at fault; router/blame.py reads the same key (it cannot import this)
BLAME_KEY = "pdserve-blame"
KV_EVENT_INTERVAL_S = 0.05  # how stale a subscriber's view of the prefix cache may be
FLUSH_TIMEOUT_S = 10.0  # a FlushCache the scheduler thread does not run by then fails


@dataclass
class NodeInfo:
    """What GetModelInfo / GetServerInfo report."""

    served_model_name: str
    model_path: str
    tokenizer_path: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    architectures: list[str]
    model_type: str
    role: str  # "null" (colocated), "prefill" or "decode"
    pairing_protocol: str | None = None
    server_args: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)


class GenerateHandler(Protocol):
    def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]: ...

    def abort(self, request_id: str, reason: str) -> bool: ...

    def disaggregation_metrics(self) -> pb.DisaggregationMetrics | None: ...

    def inflight(self) -> int:
        """Requests the role holds capacity for outside the engine's queues (engine.service.health)."""

    def stuck_reason(self) -> str | None:
        """Capacity the role itself leaked (e.g. handoff rows), or None."""


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(
        self, info: NodeInfo, loop: EngineLoop, handler: GenerateHandler, stopping: asyncio.Event | None = None
    ) -> None:
        self.info, self.loop, self.handler = info, loop, handler
        self.health = HealthWatch(
            lambda: loop.alive, lambda: leaked_capacity(loop.engine, handler), fault=lambda: loop.fault
        )
        self.stopping = stopping  # set when the node shuts down: KV event streams end then
        cache = loop.engine.kv.cache
        self.kv_events = KvEventLog(cache.page_size) if cache is not None else None
        if cache is not None:  # the cache changes on the scheduler thread only: attach it there
            loop.call(lambda: cache.set_listener(self.kv_events))

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        # Not reset at the end: this call's task (and the tasks it starts) is all the id covers.
        bind_request_id(request.request_id)
        log.debug(
            "generate: %d prompt tokens, at most %d new",
            len(request.tokenized.input_ids),
            request.sampling_params.max_new_tokens,
        )
        if not self.loop.alive:
            # a failed engine (a dead rank) may block its scheduler thread: refuse now, so the
            # router retries elsewhere instead of waiting for a thread that will not answer
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node cannot serve: {self.health.check()}")
        try:
            async for resp in self.handler.generate(request, context):
                if resp.HasField("complete"):
                    log.debug(
                        "complete: %s after %d tokens", resp.complete.finish_reason, resp.complete.completion_tokens
                    )
                yield resp
        except InvalidRequest as e:
            log.info("refused: %s", e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestFailed as e:
            log.warning("failed: %s", e)
            blame = ((BLAME_KEY, e.blame),) if e.blame else ()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e), trailing_metadata=blame)

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        why = self.health.check()
        return pb.HealthCheckResponse(healthy=why is None, message=why or "ok")

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = self.handler.abort(request.request_id, request.reason or "aborted by client")
        return pb.AbortResponse(success=True, message="aborted" if found else "unknown or finished")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        i = self.info
        return pb.GetModelInfoResponse(
            model_path=i.model_path,
            tokenizer_path=i.tokenizer_path,
            is_generation=True,
            served_model_name=i.served_model_name,
            max_context_length=i.max_context_length,
            vocab_size=i.vocab_size,
            model_type=i.model_type,
            eos_token_ids=i.eos_token_ids,
            max_req_input_len=i.max_context_length - 1,
            architectures=i.architectures,
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        args = struct_pb2.Struct()
        args.update({**self.info.server_args, "disaggregation_mode": self.info.role, "perf": self._perf()})
        # A node under a TPOT guard runs requests sent to it alone: a decode node their prompts
        # (the router's local path), a prefill node their decode steps (the whole path).
        guarded = bool(self.loop.engine.config.tpot_guard_ms)
        if self.info.role == "decode":
            args.update({"local_prefill": guarded})
        elif self.info.role == "prefill":
            args.update({"local_decode": guarded})
        if self.info.pairing_protocol:
            args.update({"pairing_protocol": self.info.pairing_protocol})
        sched = self.loop.engine.scheduler
        return pb.GetServerInfoResponse(
            server_args=args,
            active_requests=len(sched.reqs),
            server_type="grpc",
            sglang_version="pdserve",
            uptime_seconds=time.time() - self.info.started,
            max_total_num_tokens=self.loop.engine.kv.allocator.total * self.loop.engine.kv.page_size,
        )

    def _perf(self) -> dict[str, Any]:
        """What this node measured of its own speed (engine/scheduler/rates.py), and its TPOT guard:
        the router decides each request's prefill path from these."""
        config = self.loop.engine.config
        perf = self.loop.engine.rates.snapshot(config.max_running)
        perf["tpot_guard_s"] = config.tpot_guard_ms / 1000 if config.tpot_guard_ms else None
        perf["mixed_chunk"] = self.loop.engine.scheduler.policy.mixes  # its chunks ride in decode steps
        return perf

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadsResponse:
        eng = self.loop.engine
        policy, kv = eng.scheduler.policy, eng.kv
        used = kv.num_held * kv.page_size  # cached pages nobody reads are free to take
        total = kv.allocator.total * kv.page_size
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=len(policy.running),
            num_waiting_reqs=len(policy.waiting),
            num_total_reqs=len(policy.running) + len(policy.waiting),
            num_used_tokens=used,
            max_total_num_tokens=total,
            token_usage=used / max(total, 1),
            max_running_requests=eng.config.max_running,
            num_waiting_uncached_tokens=policy.queued_prompt_tokens,
            cache_hit_rate=_hit_rate(eng.scheduler.stats),
            gen_throughput=eng.rates.recent_decode_tokens_per_s(),
        )
        stats = eng.executor.spec_stats()
        if stats is not None:
            load.speculative.CopyFrom(
                pb.SpeculativeMetrics(accept_length=stats.mean_accept_len, accept_rate=stats.acceptance_rate)
            )
        disagg = self.handler.disaggregation_metrics()
        if disagg is not None:
            load.disaggregation.CopyFrom(disagg)
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version="pdserve",
            dp_rank_count=1,
            loads=[load],
        )

    async def SubscribeKvEvents(
        self, request: cpb.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cpb.KvEventBatch]:
        """The prefix cache's pages as KV events (engine/service/kv_events.py). Without a cache
        (--disable-radix-cache) there is nothing to publish: UNIMPLEMENTED, on which SMG turns
        events off for the worker and our router counts no cache hits on it."""
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no prefix cache: KV cache events are not published")
            return
        async for batch in subscribe(self.kv_events, request.start_sequence_number, KV_EVENT_INTERVAL_S, self.stopping):
            yield batch

    async def FlushCache(
        self, request: cpb.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> cpb.FlushCacheResponse:
        """Drop every cached page no request reads, now: pages running requests read stay cached
        (they are never freed under a request), so there is no need to wait for the node to go idle
        and `timeout_s` is not used."""
        cache = self.loop.engine.kv.cache
        if cache is None:
            return cpb.FlushCacheResponse(success=True, message="no prefix cache: nothing to flush")

        def flush() -> tuple[int, int]:  # on the scheduler thread, between steps
            return cache.clear(), cache.num_pages

        try:
            dropped, kept = await asyncio.wait_for(asyncio.wrap_future(self.loop.call(flush)), FLUSH_TIMEOUT_S)
        except TimeoutError:
            return cpb.FlushCacheResponse(
                success=False, message=f"the scheduler did not flush within {FLUSH_TIMEOUT_S:.0f} s"
            )
        log.info("flushed %d cached pages (%d read by running requests stay)", dropped, kept)
        return cpb.FlushCacheResponse(success=True, message=f"flushed {dropped} cached pages; {kept} in use stay")


def _hit_rate(stats: dict[str, int]) -> float:
    """The share of admitted prompt tokens found in the prefix cache, since start."""
    admitted = stats["admitted_prompt_tokens"]
    return stats["cached_prompt_tokens"] / admitted if admitted else 0.0
