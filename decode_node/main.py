"""The decode node process: scheduler API for the router; connects to prefill nodes on demand."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from decode_node.handler import DecodeHandler, DecodeTimeouts
from decode_node.peers import PeerManager, PeerPolicy
from decode_node.receiver import CompletionWaiter
from engine.compat import pairing_protocol
from engine.kv_transfer.endpoint import build_endpoint
from engine.service.server import (metrics_suffix, node_info, scheduler_service, serve_until,
                                   start_server, stop_on_signals)
from engine.service.servicer import SchedulerServicer
from engine.serving import EngineLoop
from spec.registry import SpeculativeAlgorithm

log = logging.getLogger(__name__)


async def run_decode(opts: Any, host: str, port: int, transport: str, timeouts: DecodeTimeouts,
                     policy: PeerPolicy, metrics_port: int | None = None) -> None:
    stop = stop_on_signals()
    engine, spec = opts.build()
    loop = EngineLoop(engine).start()
    algo = SpeculativeAlgorithm.from_name(spec.algorithm if spec is not None else "NONE")
    draft = spec.draft_model_path if spec is not None else None
    spec_cfg = spec.resolved() if spec is not None else None
    endpoint = build_endpoint(engine, kind=transport, role="decode", aux_rows=2 * engine.config.max_running + 1,
                              spec_algorithm=algo.name, draft_model_dir=draft)
    waiter = CompletionWaiter(endpoint.transport)
    peers = PeerManager(endpoint, policy, on_dead=waiter.fail_peer)
    handler = DecodeHandler(loop, endpoint, peers, waiter, algo, spec_cfg, timeouts)
    info = node_info(engine, "decode", pairing_protocol=pairing_protocol(endpoint.fingerprint))
    api, api_port = await start_server([scheduler_service(SchedulerServicer(info, loop, handler))], host, port)
    pump = asyncio.create_task(waiter.run())
    log.info("decode node serving %s on %s:%d", engine.config.model, host, api_port)
    print(f"READY scheduler={host}:{api_port}{metrics_suffix(engine, 'decode', host, metrics_port, handler)}",
          flush=True)

    def shutdown() -> None:
        pump.cancel()
        loop.stop()
        endpoint.transport.close()

    await serve_until(stop, [api], on_stop=shutdown)
    await peers.close()
