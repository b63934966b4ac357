"""Colocated Generate: one node runs prompt and decode (`pdserve serve`, and the PD baseline)."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.loop import EngineLoop
from engine.service import convert
from engine.service.grammar import attach_grammar
from engine.service.node import RoleParts
from engine.service.stream import RequestStream

log = logging.getLogger(__name__)


class ColocatedHandler:
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.eos = frozenset(self.engine.model_config.eos_token_ids)

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        eng = self.engine
        params = convert.sampling_params(request, eng.max_context_len)
        req = eng.make_request(list(request.tokenized.input_ids), params, request.request_id or None)
        await attach_grammar(eng, req)
        stream = RequestStream(self.loop, req, request.stream, eng.tokenizer, self.eos)
        self.loop.submit(req, stream.on_update)
        async for resp in stream.responses():
            yield resp

    def abort(self, request_id: str, reason: str) -> bool:
        self.loop.abort(request_id, reason)  # unknown or finished ids are ignored by the scheduler
        return True

    def disaggregation_metrics(self) -> pb.DisaggregationMetrics | None:
        return None

    def inflight(self) -> int:
        return 0  # everything it serves is in the engine's own queues

    def stuck_reason(self) -> str | None:
        return None


class ColocatedRole:
    """`pdserve serve`: the Generate handler runs prompt and decode itself; nothing beside the API."""

    name = "colocated"

    def attach(self, loop: EngineLoop, binding: Any, host: str) -> RoleParts:
        return RoleParts(ColocatedHandler(loop), info_role="null", on_stop=[loop.stop])

    async def start(self, host: str, health: Any) -> tuple[list[grpc.aio.Server], str]:
        return [], ""
