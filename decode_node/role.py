"""The decode role: its Generate handler, prefill peers on demand, and the completion pump."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from common.fingerprint import pairing_protocol
from decode_node.completion import CompletionWaiter
from decode_node.handler import DecodeHandler, DecodeTimeouts
from decode_node.peers import PeerManager, PeerPolicy
from engine.disagg import DisaggEngine
from engine.kv_transfer.endpoint import build_endpoint
from engine.loop import EngineLoop
from engine.service.node import RoleParts


class DecodeRole:
    """Receives KV from prefill nodes (connecting to them on demand) and generates."""

    name = "decode"

    def __init__(
        self,
        transport: str,
        timeouts: DecodeTimeouts,
        policy: PeerPolicy,
        rows_at: str = "kv",
        local_prefill_tpot_ms: float = 0.0,
    ) -> None:
        self.transport, self.timeouts, self.policy, self.rows_at = transport, timeouts, policy, rows_at
        self.local_prefill_tpot_ms = local_prefill_tpot_ms  # 0: prompts without a prefill are refused
        self._pump: asyncio.Task[None] | None = None

    def attach(self, loop: EngineLoop, binding: Any, host: str) -> RoleParts:
        engine = loop.engine
        pd = DisaggEngine.over(loop)
        endpoint = build_endpoint(
            pd,
            kind=self.transport,
            role="decode",
            rows=2 * engine.config.max_running + 1,
            spec_algorithm=binding.name,
            draft_model_dir=binding.config.draft_model_path,
            rows_at=self.rows_at,
            host=host,
        )
        self.waiter = CompletionWaiter(endpoint.transport)
        peers = PeerManager(endpoint, self.policy, on_dead=self.waiter.fail_peer)
        local = self.local_prefill_tpot_ms > 0
        handler = DecodeHandler(pd, endpoint, peers, self.waiter, binding, self.timeouts, local_prefill=local)
        return RoleParts(
            handler,
            info_role="decode",
            pairing_protocol=pairing_protocol(endpoint.fingerprint),
            describe=binding.describe(),
            runs_prompts=local,
            metrics_source=handler,
            on_stop=[self._stop_pump, loop.stop, endpoint.transport.close],
            after=[peers.close],
        )

    async def start(self, host: str, health: Any) -> tuple[list[grpc.aio.Server], str]:
        self._pump = asyncio.create_task(self.waiter.run())
        return [], ""

    def _stop_pump(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
