"""Prefill Generate: run the prompt while the decode's destination arrives, write KV + handoff
row, answer.

Decode-driven writes: nothing is written before the decode node has reserved pages and a handoff
row for this room and sent them (bounded by the bootstrap deadline). The prompt itself starts at
once, so the decode's reservation overlaps the forward instead of adding to the time to first
token; a prompt whose destination is late holds its KV on this node meanwhile, and this node's
own KV capacity is the backpressure. With chunked prefill, each finished chunk's pages are written
while the next chunk runs (see prefill_node/writer.py), so the final write carries only the last
chunk's pages and the row. The request's KV stays held after its first token until every write
ends, then returns to the pool whatever happened.
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

from common.defaults import DEFAULT_BOOTSTRAP_TIMEOUT, DEFAULT_TRANSFER_TIMEOUT
from engine.core import FinishReason, InvalidRequest, Req, SamplingParams
from engine.disagg import DisaggEngine
from engine.handoff import HandoffError
from engine.kv_transfer import KVPoll, TransferError
from engine.kv_transfer.endpoint import Endpoint, room_echo
from engine.scheduler import RequestUpdate
from engine.service import convert
from engine.service.grammar import attach_grammar
from engine.service.metrics import (
    KV_HANDOFF_STAGE_SECONDS,
    KV_HANDOFF_TAIL_SECONDS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_FAILURES,
    KV_TRANSFER_SECONDS,
    KV_WRITE_PAGES,
    KV_WRITES,
)
from engine.service.stream import RequestFailed, RequestStream
from engine.service.tombstones import Tombstones
from prefill_node.rooms import Room, RoomTable
from prefill_node.writer import RoomWriter, WriteFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillTimeouts:
    bootstrap_timeout: float = DEFAULT_BOOTSTRAP_TIMEOUT  # Generate -> destination from the decode node
    compute_timeout: float = 300.0  # Generate -> first token
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT  # write posted -> completed


class PrefillHandler:
    def __init__(
        self,
        pd: DisaggEngine,
        endpoint: Endpoint,
        rooms: RoomTable,
        timeouts: PrefillTimeouts,
        send_chunks: bool = True,
        local_decode: bool = False,
    ) -> None:
        self.pd, self.endpoint, self.rooms, self.timeouts = pd, endpoint, rooms, timeouts
        self.send_chunks = send_chunks  # chunked prefill: each chunk's pages leave as it finishes
        # requests sent without a decode node run here whole, under the engine's TPOT guard
        self.local_decode = local_decode
        # recent handoff tails (last chunk computed -> final write done), an EWMA in ms: what the
        # handoff adds to a remote prompt's time to first token, for routers' estimates
        self.tail_ms: float | None = None
        self._live_ids: set[str] = set()
        self._aborted: Tombstones[str] = Tombstones(
            ttl_s=timeouts.bootstrap_timeout
        )  # ids aborted before their Generate

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        pd = self.pd
        params = convert.sampling_params(request, pd.max_context_len)
        if not request.disaggregated_params.bootstrap_host:  # the router's whole path
            async for resp in self._whole(request, params):
                yield resp
            return
        req = pd.make_request(
            list(request.tokenized.input_ids),
            # the first token is sampled here: it obeys min_new_tokens too
            dataclasses.replace(params, max_new_tokens=1, stop=(), min_new_tokens=min(1, params.min_new_tokens)),
            request.request_id or None,
        )
        req.hold_kv = True
        await attach_grammar(pd, req)  # the first token is sampled under the grammar
        # Ids key the engine's updates and aborts: a second request with a live id (computing or
        # still writing its KV) is refused before it can touch the first one.
        if req.rid in self._live_ids:
            raise InvalidRequest(f"request id {req.rid!r} is already in flight on this node")
        room = self.rooms.get_or_create(request.disaggregated_params.bootstrap_room)
        if room.request_id:
            raise InvalidRequest(f"bootstrap_room {room.room} is already in use")
        self._refuse_if_aborted(req, room)
        self._live_ids.add(req.rid)
        room.request_id = req.rid
        room.deadline = time.monotonic() + self.timeouts.bootstrap_timeout
        writer = RoomWriter(self.endpoint.transport, room, self.timeouts.transfer_timeout, self.send_chunks)
        room.writes = writer
        try:
            first, pages = await self._compute(req, room, writer)
            await self._wait_destination(room)  # usually here long before the prompt is done
            await self._transfer(req, room, writer, pages)
        except (RequestFailed, WriteFailed, TransferError, HandoffError, asyncio.TimeoutError) as e:
            reason = str(e) or type(e).__name__
            room.fail(reason)
            KV_TRANSFER_FAILURES.labels("prefill", _kind(e)).inc()
            raise RequestFailed(f"prefill failed for room {room.room}: {reason}") from None
        except asyncio.CancelledError:  # the caller went away: the decode hears it (below)
            room.fail("prefill request cancelled")
            raise
        finally:
            self._live_ids.discard(req.rid)
            pd.abort(req.rid, "prefill ended")  # no-op once finished
            # pages back, and a failed room's decode told, once no write of the room is in flight
            writer.after_writes(lambda: self._end_room(req, room))
            if room.state is KVPoll.FAILED:  # a late destination for it must be refused
                room.deadline = time.monotonic() + self.rooms.orphan_ttl_s
            else:
                self.rooms.forget(room)
        yield convert.complete(
            req.rid, [first], FinishReason.LENGTH, len(req.prompt_ids), cached_tokens=req.cached_tokens
        )

    async def _whole(self, request: pb.GenerateRequest, params: SamplingParams) -> AsyncIterator[pb.GenerateResponse]:
        """A request sent without a decode node: prompt to last token on this node, its decode
        steps kept within the engine's TPOT guard while prompts run beside them."""
        if not self.local_decode:
            raise RequestFailed.refused_alone("prefill", "decode requests", "--local-decode-tpot-ms")
        pd = self.pd
        req = pd.make_request(list(request.tokenized.input_ids), params, request.request_id or None)
        await attach_grammar(pd, req)
        if req.rid in self._live_ids:
            raise InvalidRequest(f"request id {req.rid!r} is already in flight on this node")
        if (why := self._aborted.pop(req.rid)) is not None:  # its abort came first
            raise RequestFailed(f"request {req.rid} was aborted before it arrived: {why}", "aborted")
        self._live_ids.add(req.rid)
        try:
            stream = RequestStream(pd, req, request.stream, pd.tokenizer, pd.eos_token_ids)
            pd.submit(req, stream.on_update)
            async for resp in stream.responses():
                yield resp
        finally:
            self._live_ids.discard(req.rid)

    def _refuse_if_aborted(self, req: Req, room: Room) -> None:
        """A request whose abort came first (by id from the router, or its room from the decode)
        ends here, before it computes or holds anything; its room stays failed so a destination
        that comes later is refused too."""
        why = self._aborted.pop(req.rid)
        if why is not None:
            self.rooms.abort(room.room, why)
        if room.state is KVPoll.FAILED:
            KV_TRANSFER_FAILURES.labels("prefill", "aborted").inc()
            # nothing of it was ever written: a decode holding its destination frees it now
            room.tell_decode(self.endpoint.transport, room.reason)
            raise RequestFailed(f"room {room.room} was aborted before its request arrived: {room.reason}", "aborted")

    def _end_room(self, req: Req, room: Room) -> None:
        self.pd.release(req)
        if room.state is KVPoll.FAILED:
            room.tell_decode(self.endpoint.transport, room.reason)

    async def _wait_destination(self, room: Room) -> None:
        # Checked first: after a prompt longer than the bootstrap deadline a destination that came
        # in time is still good, and wait_for with no time left would refuse even a set event.
        left = room.deadline - time.monotonic()
        try:
            if not room.arrived.is_set():
                await asyncio.wait_for(room.arrived.wait(), max(left, 0.0))
        except asyncio.TimeoutError:
            raise RequestFailed(
                f"no destination from the decode node within {self.timeouts.bootstrap_timeout:.0f} s",
                "bootstrap_timeout",
            ) from None
        if room.state is KVPoll.FAILED:
            raise RequestFailed(room.reason, "aborted")
        if room.state is KVPoll.BOOTSTRAPPING:  # chunk writes may already be TRANSFERRING
            room.state = KVPoll.WAITING_FOR_INPUT

    async def _compute(self, req: Req, room: Room, writer: RoomWriter) -> tuple[int, list[int]]:
        """Run the prompt; pages of finished chunks go to the decode meanwhile (`writer`).
        Returns the first token and the request's pages (as the finishing update reported them)."""
        aio = asyncio.get_running_loop()
        done: asyncio.Future[RequestUpdate] = aio.create_future()

        def on_update(upd: RequestUpdate) -> None:  # scheduler thread
            if upd.kv_progress is not None:
                writer.offer(upd.kv_progress, aio)
            if upd.finished:
                room.finished_at = time.perf_counter()
                aio.call_soon_threadsafe(lambda: done.done() or done.set_result(upd))

        self.pd.submit(req, on_update)  # an abort (client or decode) finishes it as ABORT
        watch = asyncio.ensure_future(self._abort_on_room_failure(req, room))
        try:
            upd = await asyncio.wait_for(done, self.timeouts.compute_timeout)
        finally:
            watch.cancel()
        if upd.finish_reason is FinishReason.ABORT or room.state is KVPoll.FAILED:
            raise RequestFailed(room.reason or upd.finish_detail or "aborted", "aborted")
        if upd.held_pages is None:  # the scheduler names a held request's pages when it ends
            raise RequestFailed(f"request {req.rid} finished without its pages", "no_pages")
        return req.output_ids[0], list(upd.held_pages)

    async def _abort_on_room_failure(self, req: Req, room: Room) -> None:
        """A room that fails while its prompt runs (the decode aborted it) stops the forward."""
        await room.failed.wait()
        self.pd.abort(req.rid, room.reason)

    async def _transfer(self, req: Req, room: Room, writer: RoomWriter, pages: list[int]) -> None:
        """The pages not sent with a chunk + the handoff row, once every chunk write ended. An
        abort meanwhile does not cut a posted write short: released in flight, it might still
        land later in pages the decode has handed to someone else."""
        computed = time.perf_counter()
        stage = KV_HANDOFF_STAGE_SECONDS.labels
        if room.finished_at is not None:
            stage("handover").observe(computed - room.finished_at)
        dest = room.destination
        assert dest is not None
        pd, rows = self.pd, self.endpoint.rows
        need = pd.pages_for(req.seq_len)
        if len(dest.pages) != need or dest.num_tokens != req.seq_len:
            raise RequestFailed(
                f"destination holds {len(dest.pages)} pages for {dest.num_tokens} tokens; "
                f"the prompt needs {need} pages for {req.seq_len} tokens",
                "bad_destination",
            )
        t = time.perf_counter()
        # microseconds of work: the finishing update names the pages (it once did not, and the
        # round trip to the scheduler thread for them waited out a step, 7-14 ms under load)
        stage("check").observe(t - computed)
        payload = pd.encode_handoff(req)
        encoded = time.perf_counter()
        sent = await writer.settle_chunks()
        settled = time.perf_counter()
        stage("encode").observe(encoded - t)
        stage("settle").observe(settled - encoded)
        row = rows.alloc()
        if row is None:
            raise RequestFailed("no free handoff row on the prefill node", "no_aux_row")
        try:
            rows.write(row, room_echo(room.room), payload)
            if room.state is KVPoll.FAILED:  # aborted while computing: never post into its pages
                raise RequestFailed(room.reason, "aborted")
            room.state = KVPoll.TRANSFERRING
            posted = time.perf_counter()
            stage("row").observe(posted - settled)
            await writer.write_final(pages[sent:need], dest.pages[sent:need], row, dest.aux_row)
            if room.state is KVPoll.FAILED:
                raise RequestFailed(room.reason, "aborted")
            room.state = KVPoll.SUCCESS
        finally:
            writer.after_writes(lambda: rows.free(row))  # the row is a write's source until it ends
        now = time.perf_counter()
        KV_TRANSFER_SECONDS.labels("prefill").observe(now - posted)
        KV_HANDOFF_TAIL_SECONDS.observe(now - computed)
        tail_ms = (now - computed) * 1000
        self.tail_ms = tail_ms if self.tail_ms is None else 0.8 * self.tail_ms + 0.2 * tail_ms
        KV_WRITES.labels("chunk").inc(writer.partial_writes)
        KV_WRITES.labels("final").inc()
        KV_WRITE_PAGES.labels("chunk").inc(writer.partial_pages)
        KV_WRITE_PAGES.labels("final").inc(need - sent)
        written = writer.partial_pages + need - sent  # the decode's cached pages are not written
        KV_TRANSFER_BYTES.labels("prefill").inc(written * pd.kv_bytes_per_page + rows.row_bytes)

    def abort(self, request_id: str, reason: str) -> bool:
        self.pd.abort(request_id, reason)
        room = self.rooms.by_request(request_id)
        if room is None:  # a whole request (the engine's abort ended it), or one still to come
            live = request_id in self._live_ids
            if not live:  # its Generate has not come (yet): it ends on arrival
                self._aborted.add(request_id, reason)
            return live
        room.fail(reason)
        return True

    def inflight(self) -> int:
        return len(self.rooms)  # rooms hold KV until their write ends (hold_kv)

    def stuck_reason(self) -> str | None:
        rows = self.endpoint.rows
        return f"all {rows.num_used} handoff rows are held with no room open" if not rows.num_free else None

    def disaggregation_metrics(self) -> pb.DisaggregationMetrics:
        c = self.rooms.counts()
        return pb.DisaggregationMetrics(
            mode="prefill",
            prefill_prealloc_queue_reqs=c.get("BOOTSTRAPPING", 0),
            prefill_inflight_queue_reqs=c.get("WAITING_FOR_INPUT", 0) + c.get("TRANSFERRING", 0),
            kv_transfer_latency_ms=self.tail_ms or 0.0,
        )


def _kind(e: BaseException) -> str:
    if isinstance(e, (RequestFailed, WriteFailed)):
        return e.kind
    if isinstance(e, HandoffError):
        return "bad_handoff"
    return "transfer_error" if isinstance(e, TransferError) else "timeout"
