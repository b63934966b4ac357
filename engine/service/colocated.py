"""Colocated Generate: one node runs prompt and decode (`pdserve serve`, and the PD baseline)."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.service import convert
from engine.service.stream import RequestStream
from engine.loop import EngineLoop

log = logging.getLogger(__name__)


class ColocatedHandler:
    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.eos = frozenset(self.engine.model_config.eos_token_ids)

    async def generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        eng = self.engine
        params = convert.sampling_params(request, eng.max_context_len)
        req = eng.make_request(list(request.tokenized.input_ids), params, request.request_id or None)
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


async def run_colocated(opts: Any, host: str, port: int, metrics_port: int | None = None) -> None:
    """`pdserve serve`: load, serve the scheduler API, stop cleanly on SIGINT/SIGTERM."""
    from engine.service.server import (metrics_suffix, node_info, scheduler_service, serve_until,
                                       start_server, stop_on_signals)
    from engine.service.servicer import SchedulerServicer
    from engine.loop import EngineLoop

    stop = stop_on_signals()
    engine, _ = opts.build()
    loop = EngineLoop(engine).start()
    servicer = SchedulerServicer(node_info(engine, "null"), loop, ColocatedHandler(loop))
    server, bound = await start_server([scheduler_service(servicer)], host, port, watch=servicer.health)
    log.info("colocated node serving %s on %s:%d", engine.config.model, host, bound)
    print(f"READY scheduler={host}:{bound}{metrics_suffix(engine, 'colocated', host, metrics_port)}", flush=True)
    await serve_until(stop, [server], on_stop=loop.stop)
