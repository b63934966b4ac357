"""Prefill Generate: wait for the decode's destination, run the prompt, write KV + handoff row, answer.

Decode-driven: the prompt is computed only once the decode node has reserved pages and a handoff
row for this room (that is the system's backpressure), bounded by the bootstrap deadline. The
request's KV stays held after its first token until the write ends, then returns to the pool
whatever happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.core import FinishReason, InvalidRequest, Req
from engine.disagg import DisaggEngine
from engine.handoff import HandoffError
from engine.kv_transfer import KVPoll, TransferError, TransferRequest
from engine.kv_transfer.endpoint import Endpoint, room_echo
from engine.scheduler import RequestUpdate
from engine.service import convert
from engine.service.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES, KV_TRANSFER_SECONDS
from engine.service.stream import RequestFailed
from prefill_node.rooms import Room, RoomTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillTimeouts:
    bootstrap_s: float = 30.0  # Generate -> destination from the decode node
    compute_s: float = 300.0  # destination -> first token
    transfer_s: float = 30.0  # write posted -> completed


class PrefillHandler:
    def __init__(self, pd: DisaggEngine, endpoint: Endpoint, rooms: RoomTable,
                 timeouts: PrefillTimeouts) -> None:
        self.pd, self.endpoint, self.rooms, self.timeouts = pd, endpoint, rooms, timeouts
        self._orphans: dict[str, asyncio.Future] = {}  # rid -> the end of a cancelled request's write

    async def generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        pd = self.pd
        params = convert.sampling_params(request, pd.max_context_len)
        req = pd.make_request(list(request.tokenized.input_ids),
                              # the first token is sampled here: it obeys min_new_tokens too
                              dataclasses.replace(params, max_new_tokens=1, stop=(),
                                                  min_new_tokens=min(1, params.min_new_tokens)),
                              request.request_id or None)
        req.hold_kv = True
        room = self.rooms.get_or_create(request.disaggregated_params.bootstrap_room)
        if room.request_id:
            raise InvalidRequest(f"bootstrap_room {room.room} is already in use")
        room.request_id = req.rid
        room.deadline = time.monotonic() + self.timeouts.bootstrap_s
        try:
            await self._wait_destination(room)
            first = await self._compute(req, room)
            await self._transfer(req, room, first)
        except (RequestFailed, TransferError, HandoffError, asyncio.TimeoutError) as e:
            reason = str(e) or type(e).__name__
            room.fail(reason)
            room.tell_decode(self.endpoint.transport, reason)
            KV_TRANSFER_FAILURES.labels("prefill", e.kind if isinstance(e, RequestFailed) else _kind(e)).inc()
            raise RequestFailed(f"prefill failed for room {room.room}: {reason}") from None
        except asyncio.CancelledError:  # the caller went away: the decode hears it now
            in_flight = room.state is KVPoll.TRANSFERRING  # then the write's own end tells it
            room.fail("prefill request cancelled")
            if not in_flight:
                room.tell_decode(self.endpoint.transport, room.reason)
            raise
        finally:
            pd.abort(req.rid, "prefill ended")  # no-op once finished
            if req.rid not in self._orphans:  # else a posted write still reads its pages
                pd.release(req)
            if room.state is KVPoll.FAILED:  # a late destination for it must be refused
                room.deadline = time.monotonic() + self.rooms.orphan_ttl_s
            else:
                self.rooms.forget(room)
        yield convert.complete(req.rid, [first], FinishReason.LENGTH, len(req.prompt_ids))

    async def _wait_destination(self, room: Room) -> None:
        left = room.deadline - time.monotonic()
        try:
            await asyncio.wait_for(room.arrived.wait(), max(left, 0.0))
        except asyncio.TimeoutError:
            raise RequestFailed(f"no destination from the decode node within "
                                f"{self.timeouts.bootstrap_s:.0f} s", "bootstrap_timeout") from None
        if room.state is KVPoll.FAILED:
            raise RequestFailed(room.reason, "aborted")
        room.state = KVPoll.WAITING_FOR_INPUT

    async def _compute(self, req: Req, room: Room) -> int:
        done: asyncio.Future[RequestUpdate] = asyncio.get_running_loop().create_future()
        aio = asyncio.get_running_loop()

        def on_update(upd: RequestUpdate) -> None:
            if upd.finished:
                aio.call_soon_threadsafe(lambda: done.done() or done.set_result(upd))

        self.pd.submit(req, on_update)  # an abort (client or decode) finishes it as ABORT
        upd = await asyncio.wait_for(done, self.timeouts.compute_s)
        if upd.finish_reason is FinishReason.ABORT or room.state is KVPoll.FAILED:
            raise RequestFailed(room.reason or upd.finish_detail or "aborted", "aborted")
        return req.output_ids[0]

    async def _transfer(self, req: Req, room: Room, first: int) -> None:
        dest = room.destination
        assert dest is not None
        pd, rows = self.pd, self.endpoint.rows
        pages = await asyncio.wrap_future(pd.page_list(req))
        need = pd.pages_for(req.seq_len)
        if len(dest.pages) != need or dest.num_tokens != req.seq_len:
            raise RequestFailed(f"destination holds {len(dest.pages)} pages for {dest.num_tokens} tokens; "
                                f"the prompt needs {need} pages for {req.seq_len} tokens", "bad_destination")
        payload = pd.encode_handoff(req)
        row = rows.alloc()
        if row is None:
            raise RequestFailed("no free handoff row on the prefill node", "no_aux_row")
        handle = None
        try:
            rows.write(row, room_echo(room.room), payload)
            if room.state is KVPoll.FAILED:  # aborted while computing: never post into its pages
                raise RequestFailed(room.reason, "aborted")
            room.state = KVPoll.TRANSFERRING
            room.deadline = time.monotonic() + self.timeouts.transfer_s
            posted = time.perf_counter()
            # posting may copy synchronously (CPU); keep the event loop serving meanwhile
            handle = await asyncio.to_thread(self.endpoint.transport.write, TransferRequest(
                room.room, dest.peer, pages[:need], dest.pages, row, dest.aux_row))
            await self._poll(handle, room)
            room.state = KVPoll.SUCCESS
            KV_TRANSFER_SECONDS.labels("prefill").observe(time.perf_counter() - posted)
            KV_TRANSFER_BYTES.labels("prefill").inc(need * pd.kv_bytes_per_page + rows.row_bytes)
        except asyncio.CancelledError:
            if handle is not None:  # the write runs on: release it once it ended, then tell the decode
                self._orphans[req.rid] = asyncio.ensure_future(self._end_orphaned_write(handle, room, row, req))
                handle = row = None
            raise
        finally:
            if handle is not None:
                self.endpoint.transport.release(handle)
            if row is not None:
                rows.free(row)

    async def _end_orphaned_write(self, handle: object, room: Room, row: int, req: Req) -> None:
        """A cancelled request's posted write: wait for its end (bounded by the room deadline),
        then free its handle, row and source pages, and tell the decode that this room failed."""
        try:
            await self._poll(handle, room)
        except RequestFailed:
            pass
        finally:
            self.endpoint.transport.release(handle)
            self.endpoint.rows.free(row)
            del self._orphans[req.rid]
            self.pd.release(req)
            room.tell_decode(self.endpoint.transport, room.reason or "prefill request cancelled")

    async def _poll(self, handle: object, room: Room) -> None:
        """Until the posted write ends. An abort meanwhile does not cut it short: a write released
        in flight might still land later, in pages the decode node has handed to someone else;
        the decode keeps them until it hears how this write ended."""
        t = self.endpoint.transport
        while True:
            state = t.poll(handle)
            if state is KVPoll.SUCCESS:
                if room.state is KVPoll.FAILED:
                    raise RequestFailed(room.reason, "aborted")
                return
            if state is KVPoll.FAILED:
                raise RequestFailed(f"KV write failed: {t.last_error(handle) or 'unknown reason'}",
                                    "transfer_error")
            if time.monotonic() > room.deadline:
                raise RequestFailed(f"KV write did not finish within {self.timeouts.transfer_s:.0f} s",
                                    "transfer_timeout")
            await asyncio.sleep(0.001)

    def abort(self, request_id: str, reason: str) -> bool:
        self.pd.abort(request_id, reason)
        room = self.rooms.by_request(request_id)
        if room is not None:
            room.fail(reason)
        return room is not None

    def inflight(self) -> int:
        return len(self.rooms)  # rooms hold KV until their write ends (hold_kv)

    def stuck_reason(self) -> str | None:
        rows = self.endpoint.rows
        return f"all {rows.num_used} handoff rows are held with no room open" if not rows.num_free else None

    def disaggregation_metrics(self) -> pb.DisaggregationMetrics:
        c = self.rooms.counts()
        return pb.DisaggregationMetrics(
            mode="prefill", prefill_prealloc_queue_reqs=c.get("BOOTSTRAPPING", 0),
            prefill_inflight_queue_reqs=c.get("WAITING_FOR_INPUT", 0) + c.get("TRANSFERRING", 0))



def _kind(e: BaseException) -> str:
    if isinstance(e, HandoffError):
        return "bad_handoff"
    return "transfer_error" if isinstance(e, TransferError) else "timeout"
