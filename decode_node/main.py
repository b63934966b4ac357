"""The decode node process: scheduler API for the router; connects to prefill nodes on demand."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from decode_node.handler import DecodeHandler, DecodeTimeouts
from decode_node.peers import PeerManager, PeerPolicy
from decode_node.completion import CompletionWaiter
from common.fingerprint import pairing_protocol
from engine.disagg import DisaggEngine
from engine.kv_transfer.endpoint import build_endpoint
from engine.service.server import (metrics_suffix, node_info, scheduler_service, serve_until,
                                   start_server, stop_on_signals)
from engine.service.servicer import SchedulerServicer
from engine.loop import EngineLoop

log = logging.getLogger(__name__)


async def run_decode(opts: Any, host: str, port: int, transport: str, timeouts: DecodeTimeouts,
                     policy: PeerPolicy, metrics_port: int | None = None) -> None:
    stop = stop_on_signals()
    engine, binding = opts.build()
    loop = EngineLoop(engine).start()
    pd = DisaggEngine.over(loop)
    endpoint = build_endpoint(pd, kind=transport, role="decode", rows=2 * engine.config.max_running + 1,
                              spec_algorithm=binding.name, draft_model_dir=binding.config.draft_model_path)
    waiter = CompletionWaiter(endpoint.transport)
    peers = PeerManager(endpoint, policy, on_dead=waiter.fail_peer)
    handler = DecodeHandler(pd, endpoint, peers, waiter, binding, timeouts)
    info = node_info(engine, "decode", pairing_protocol=pairing_protocol(endpoint.fingerprint))
    servicer = SchedulerServicer(info, loop, handler)
    api, api_port = await start_server([scheduler_service(servicer)], host, port, watch=servicer.health)
    pump = asyncio.create_task(waiter.run())
    log.info("decode node serving %s on %s:%d (%s)", engine.config.model, host, api_port, binding.describe())
    print(f"READY scheduler={host}:{api_port}{metrics_suffix(engine, 'decode', host, metrics_port, handler)}",
          flush=True)

    def shutdown() -> None:
        pump.cancel()
        loop.stop()
        endpoint.transport.close()

    await serve_until(stop, [api], on_stop=shutdown)
    await peers.close()
