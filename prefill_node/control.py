"""The KV control channel the prefill node serves: handshake, destinations, aborts (decode-driven)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.fingerprint import Fingerprint, first_mismatch
from engine.kv_transfer import KVPoll, TransferError
from engine.kv_transfer.endpoint import Endpoint
from engine.kv_transfer.wire import layout_from_proto, layout_to_proto
from pdserve.v1 import kv_control_pb2 as kpb
from pdserve.v1 import kv_control_pb2_grpc as kpb_grpc
from prefill_node.rooms import Destination, RoomTable

log = logging.getLogger(__name__)


class KVControlServicer(kpb_grpc.KVControlServicer):
    def __init__(self, endpoint: Endpoint, rooms: RoomTable) -> None:
        self.endpoint, self.rooms = endpoint, rooms
        self.peers: set[str] = set()

    async def Handshake(
        self, request: kpb.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> kpb.HandshakeResponse:
        mine = self.endpoint.fingerprint
        theirs = Fingerprint.from_proto(request.fingerprint)
        diff = first_mismatch(mine, theirs, "prefill", "decode")
        if diff is not None:
            log.warning("refusing decode %s: %s", request.decode_agent, diff)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible pair: {diff}")
        try:
            peer = await asyncio.to_thread(
                self.endpoint.transport.add_peer, request.nixl_metadata, layout_from_proto(request.layout)
            )
        except TransferError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"incompatible pair: {e}")
        self.peers.add(peer)
        t = self.endpoint.transport
        return kpb.HandshakeResponse(
            prefill_agent=t.name,
            nixl_metadata=t.metadata(),
            layout=layout_to_proto(t.layout()),
            fingerprint=mine.to_proto(),
        )

    async def SendDestination(
        self, request: kpb.DestinationRequest, context: grpc.aio.ServicerContext
    ) -> kpb.DestinationAck:
        if request.decode_agent not in self.peers:
            return kpb.DestinationAck(accepted=False, error="unknown decode agent: handshake first")
        left = context.time_remaining()
        if left is not None and left <= 0:  # the decode gave up on this call (and aborts the room)
            return kpb.DestinationAck(accepted=False, error="the destination came after its call's deadline")
        room = self.rooms.get_or_create(request.room)
        if room.reason:
            return kpb.DestinationAck(accepted=False, error=f"room {request.room} failed: {room.reason}")
        if room.destination is not None:
            return kpb.DestinationAck(accepted=False, error=f"room {request.room} already has a destination")
        if request.cached_pages > len(request.pages):
            return kpb.DestinationAck(
                accepted=False,
                error=f"{request.cached_pages} cached pages of a destination of {len(request.pages)}",
            )
        room.destination = Destination(
            request.decode_agent, list(request.pages), request.aux_row, request.num_tokens, request.cached_pages
        )
        room.arrived.set()
        return kpb.DestinationAck(accepted=True)

    async def AbortRoom(self, request: kpb.AbortRoomRequest, context: grpc.aio.ServicerContext) -> kpb.AbortRoomAck:
        """Fail the room and say whether the decode may free its destination now. No await from
        here to the answer, and every post checks for a failed room first: when the answer is
        "none in flight", no write of the room can be posted afterwards either."""
        # An abort may overtake the destination or the router's prefill leg: an unknown room is
        # kept as failed (for the orphan TTL), so either is refused when it comes.
        room = self.rooms.abort(request.room, f"aborted by decode: {request.reason or 'no reason given'}")
        if room.writing:  # the writer's end tells the decode (completion or failure notification)
            return kpb.AbortRoomAck(writes=kpb.ROOM_WRITES_IN_FLIGHT)
        if room.state is KVPoll.FAILED:  # also as a notification, for a decode that ignores the answer
            room.tell_decode(self.endpoint.transport, room.reason)
        return kpb.AbortRoomAck(writes=kpb.ROOM_WRITES_NONE_IN_FLIGHT)
