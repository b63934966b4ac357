"""The prefill role: its Generate handler, and the KV control channel decode nodes connect to."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from common.fingerprint import pairing_protocol
from engine.disagg import DisaggEngine
from engine.kv_transfer import KVTransport
from engine.kv_transfer.endpoint import build_endpoint
from engine.loop import EngineLoop
from engine.service.node import RoleParts
from engine.service.server import start_server
from pdserve.v1 import kv_control_pb2_grpc as kpb_grpc
from prefill_node.control import KVControlServicer
from prefill_node.handler import PrefillHandler, PrefillTimeouts
from prefill_node.rooms import RoomTable


log = logging.getLogger(__name__)


class PrefillRole:
    """Runs prompts and writes their KV to decode nodes; serves KVControl on `bootstrap_port`."""

    name = "prefill"

    def __init__(
        self,
        bootstrap_port: int,
        transport: str,
        timeouts: PrefillTimeouts,
        send_chunks: bool = True,
        rows_at: str = "kv",
        sgl: str = "off",
        local_decode: bool = False,
    ) -> None:
        self.bootstrap_port, self.transport, self.timeouts = bootstrap_port, transport, timeouts
        self.send_chunks, self.rows_at, self.sgl = send_chunks, rows_at, sgl
        self.local_decode = local_decode  # requests sent without a decode node run here whole
        self._janitor: asyncio.Task[None] | None = None

    def attach(self, loop: EngineLoop, binding: Any, host: str) -> RoleParts:
        engine = loop.engine
        pd = DisaggEngine.over(loop)
        self.endpoint = build_endpoint(
            pd,
            kind=self.transport,
            role="prefill",
            rows=2 * engine.config.max_running + 1,
            spec_algorithm=binding.name,
            draft_model_dir=binding.config.draft_model_path,
            rows_at=self.rows_at,
            host=host,
            sgl=self.sgl,
        )
        self.rooms = RoomTable(orphan_ttl_s=self.timeouts.bootstrap_timeout)
        handler = PrefillHandler(
            pd, self.endpoint, self.rooms, self.timeouts, self.send_chunks, local_decode=self.local_decode
        )
        return RoleParts(
            handler,
            info_role="prefill",
            pairing_protocol=pairing_protocol(self.endpoint.fingerprint),
            describe=binding.describe(),
            metrics_source=handler,
            on_stop=[self._stop_janitor, loop.stop, self.endpoint.transport.close],
        )

    async def start(self, host: str, health: Any) -> tuple[list[grpc.aio.Server], str]:
        control = (
            kpb_grpc.add_KVControlServicer_to_server,
            KVControlServicer(self.endpoint, self.rooms),
            "pdserve.v1.KVControl",
        )
        boot, boot_port = await start_server([control], host, self.bootstrap_port, watch=health)
        self._janitor = asyncio.create_task(_expire_orphans(self.rooms, self.endpoint.transport))
        return [boot], f" bootstrap={host}:{boot_port}"

    def _stop_janitor(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()


JANITOR_TICK_S = 0.05


async def _expire_orphans(rooms: RoomTable, transport: KVTransport) -> None:
    """Rooms past their TTL go, and a decode still holding one's destination is told (no write
    into it can land: a room with one in flight is kept). Each tick also drives the transport:
    with no progress thread a notification sent on a connection no write has used yet (a failed
    room's, before anything was written) only goes out while the sender progresses, and a
    prefill otherwise progresses only while it polls its writes."""
    while True:
        await asyncio.sleep(JANITOR_TICK_S)
        for message in transport.drain_notifications():  # a prefill expects none
            log.debug("ignoring a notification to the prefill: %r", message)
        for room in rooms.expire_orphans():
            room.tell_decode(transport, room.reason)
