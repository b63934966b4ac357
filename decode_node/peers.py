"""Connections from a decode node to prefill nodes: handshake with backoff, heartbeats.

The handshake retries with exponential backoff and jitter (tenacity), bounded in attempts and
total time, so a prefill that starts later is picked up and one that never answers is a clear
error. A heartbeat (standard gRPC health) marks a dead prefill and fails its rooms.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from common.defaults import DEFAULT_CONNECT_ATTEMPTS, DEFAULT_CONNECT_TIMEOUT, DEFAULT_HEARTBEAT_INTERVAL
from common.fingerprint import Fingerprint, first_mismatch
from common.logs import context_without_request
from engine.kv_transfer.endpoint import Endpoint
from engine.kv_transfer.wire import layout_from_proto, layout_to_proto
from engine.service.metrics import BOOTSTRAP_ATTEMPTS
from pdserve.v1 import kv_control_pb2 as kpb
from pdserve.v1 import kv_control_pb2_grpc as kpb_grpc

log = logging.getLogger(__name__)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
ABORT_ROOM_TIMEOUT_S = 1.0  # per attempt; the prefill answers without waiting on anything


class PeerError(RuntimeError):
    """A prefill node that cannot be used (unreachable within the bound, or incompatible)."""


@dataclass(frozen=True)
class PeerPolicy:
    connect_attempts: int = DEFAULT_CONNECT_ATTEMPTS
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    rpc_timeout_s: float = 5.0
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    heartbeat_failures: int = 3


@dataclass
class Peer:
    address: str
    agent: str
    channel: grpc.aio.Channel
    stub: kpb_grpc.KVControlStub
    alive: bool = True
    heartbeat: asyncio.Task | None = field(default=None, repr=False)


class PeerManager:
    def __init__(self, endpoint: Endpoint, policy: PeerPolicy, on_dead: Callable[[str, str], None]) -> None:
        self.endpoint, self.policy, self.on_dead = endpoint, policy, on_dead
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Task] = {}

    def connected(self, host: str, port: int) -> Peer | None:
        """The live peer at host:port if one is connected now (no handshake)."""
        peer = self._peers.get(f"{host}:{port}")
        return peer if peer is not None and peer.alive else None

    async def get(self, host: str, port: int) -> Peer:
        """The connected peer at host:port, handshaking (with backoff) on first use."""
        address = f"{host}:{port}"
        peer = self._peers.get(address)
        if peer is not None and peer.alive:
            return peer
        task = self._connecting.get(address)
        if task is None:  # one handshake per address, however many requests wait for it
            # the handshake and the heartbeats it starts serve every request, not the one that came first
            task = self._connecting[address] = asyncio.create_task(
                self._connect(address), context=context_without_request()
            )
            task.add_done_callback(lambda _: self._connecting.pop(address, None))
        return await asyncio.shield(task)

    async def _connect(self, address: str) -> Peer:
        p = self.policy
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(p.connect_attempts) | stop_after_delay(p.connect_timeout),
                wait=wait_exponential_jitter(initial=0.1, max=2.0, jitter=0.2),
                retry=retry_if_exception(_retryable),
                reraise=False,
            ):
                with attempt:
                    try:
                        peer = await self._handshake(address)
                    except Exception:
                        BOOTSTRAP_ATTEMPTS.labels("failed").inc()
                        raise
                    BOOTSTRAP_ATTEMPTS.labels("ok").inc()
                    return peer
        except RetryError as e:
            cause = e.last_attempt.exception()
            raise PeerError(
                f"prefill bootstrap {address} unreachable after "
                f"{e.last_attempt.attempt_number} attempts: {_describe(cause)}"
            ) from None
        raise PeerError(f"prefill bootstrap {address}: no attempt made")  # pragma: no cover

    async def _handshake(self, address: str) -> Peer:
        ep = self.endpoint
        channel = grpc.aio.insecure_channel(address)
        stub = kpb_grpc.KVControlStub(channel)
        req = kpb.HandshakeRequest(
            decode_agent=ep.transport.name,
            nixl_metadata=ep.transport.metadata(),
            layout=layout_to_proto(ep.transport.layout()),
            fingerprint=ep.fingerprint.to_proto(),
        )
        try:
            resp = await stub.Handshake(req, timeout=self.policy.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            await channel.close()
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise PeerError(e.details()) from None
            raise
        diff = first_mismatch(Fingerprint.from_proto(resp.fingerprint), ep.fingerprint, "prefill", "decode")
        if diff is not None:  # the prefill checks too; this guards against an older prefill
            await channel.close()
            raise PeerError(f"incompatible pair: {diff}")
        # the prefill initiates every write and notification, and connects from its side during
        # this handshake: the decode only loads its metadata
        await asyncio.to_thread(
            ep.transport.add_peer, resp.nixl_metadata, layout_from_proto(resp.layout), connect=False
        )
        peer = Peer(address, resp.prefill_agent, channel, stub)
        old = self._peers.get(address)
        if old is not None:
            self._drop(old)
        self._peers[address] = peer
        peer.heartbeat = asyncio.create_task(self._heartbeat(peer))
        log.info("connected to prefill %s (agent %s)", address, peer.agent)
        return peer

    async def _heartbeat(self, peer: Peer) -> None:
        health = health_pb2_grpc.HealthStub(peer.channel)
        misses = 0
        while peer.alive:
            await asyncio.sleep(self.policy.heartbeat_interval)
            try:
                r = await health.Check(
                    health_pb2.HealthCheckRequest(service="pdserve.v1.KVControl"), timeout=self.policy.rpc_timeout_s
                )
                misses = 0 if r.status == health_pb2.HealthCheckResponse.SERVING else misses + 1
            except grpc.aio.AioRpcError:
                misses += 1
            if misses >= self.policy.heartbeat_failures:
                log.warning("prefill %s missed %d heartbeats; failing its rooms", peer.address, misses)
                self._drop(peer)
                self.on_dead(peer.agent, f"prefill {peer.address} stopped answering heartbeats")

    def _drop(self, peer: Peer) -> None:
        peer.alive = False
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        try:
            self.endpoint.transport.remove_peer(peer.agent)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if peer.heartbeat is not None and peer.heartbeat is not asyncio.current_task():
            peer.heartbeat.cancel()
        asyncio.ensure_future(peer.channel.close())

    async def abort_room(self, peer: Peer, room: int, reason: str) -> kpb.RoomWrites:
        """Tell the prefill to give up on `room`; returns what it says about writes into the
        room's destination (UNSPECIFIED when it cannot be asked: its notification, its death
        or the decode's deadline then frees the pages). A lost answer is asked again (the abort
        is idempotent): it is what lets the decode free the pages at once."""
        p = self.policy
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(3) | stop_after_delay(p.rpc_timeout_s),
                wait=wait_exponential_jitter(initial=0.05, max=0.5, jitter=0.05),
                retry=retry_if_exception(_retryable),
                reraise=True,
            ):
                with attempt:
                    ack = await peer.stub.AbortRoom(
                        kpb.AbortRoomRequest(room=room, reason=reason[:200]), timeout=ABORT_ROOM_TIMEOUT_S
                    )
                    return ack.writes
        except grpc.aio.AioRpcError as e:
            log.debug("AbortRoom for room %d at %s: %s", room, peer.address, _describe(e))
        return kpb.ROOM_WRITES_UNSPECIFIED

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)


def _retryable(e: BaseException) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() in RETRYABLE


def _describe(e: BaseException | None) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return repr(e)
