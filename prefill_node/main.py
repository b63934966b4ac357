"""The prefill node process: scheduler API for the router, KV control channel for decode nodes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from common.fingerprint import pairing_protocol
from engine.disagg import DisaggEngine
from engine.kv_transfer.endpoint import build_endpoint
from engine.service.server import (metrics_suffix, node_info, scheduler_service, serve_until,
                                   start_server, stop_on_signals)
from engine.service.servicer import SchedulerServicer
from engine.loop import EngineLoop
from pdserve.v1 import kv_control_pb2_grpc as kpb_grpc
from prefill_node.control import KVControlServicer
from prefill_node.handler import PrefillHandler, PrefillTimeouts
from prefill_node.rooms import RoomTable

log = logging.getLogger(__name__)


async def run_prefill(opts: Any, host: str, port: int, bootstrap_port: int, transport: str,
                      timeouts: PrefillTimeouts, metrics_port: int | None = None) -> None:
    stop = stop_on_signals()
    engine, binding = opts.build()
    loop = EngineLoop(engine).start()
    pd = DisaggEngine.over(loop)
    endpoint = build_endpoint(pd, kind=transport, role="prefill", rows=2 * engine.config.max_running + 1,
                              spec_algorithm=binding.name, draft_model_dir=binding.config.draft_model_path)
    rooms = RoomTable(orphan_ttl_s=timeouts.bootstrap_s)
    handler = PrefillHandler(pd, endpoint, rooms, timeouts)
    info = node_info(engine, "prefill", pairing_protocol=pairing_protocol(endpoint.fingerprint))
    servicer = SchedulerServicer(info, loop, handler)
    api, api_port = await start_server([scheduler_service(servicer)], host, port, watch=servicer.health)
    control = (kpb_grpc.add_KVControlServicer_to_server, KVControlServicer(endpoint, rooms),
               "pdserve.v1.KVControl")
    boot, boot_port = await start_server([control], host, bootstrap_port, watch=servicer.health)
    janitor = asyncio.create_task(_expire_orphans(rooms))
    log.info("prefill node serving %s: scheduler %s:%d, bootstrap %s:%d (%s)", engine.config.model,
             host, api_port, host, boot_port, binding.describe())
    print(f"READY scheduler={host}:{api_port} bootstrap={host}:{boot_port}"
          f"{metrics_suffix(engine, 'prefill', host, metrics_port, handler)}", flush=True)

    def shutdown() -> None:
        janitor.cancel()
        loop.stop()
        endpoint.transport.close()

    await serve_until(stop, [api, boot], on_stop=shutdown)


async def _expire_orphans(rooms: RoomTable) -> None:
    while True:
        await asyncio.sleep(1.0)
        rooms.expire_orphans()
