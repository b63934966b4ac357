"""Decode Generate: reserve pages + a handoff row, send the destination, wait for the write,
check the room echo, rebuild the draft input, join the running batch and stream tokens; or, for a
request with no bootstrap (the router's local path), run its prompt here, between decode steps."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import torch
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from common.defaults import DEFAULT_BOOTSTRAP_PORT, DEFAULT_WAITING_TIMEOUT
from engine.core import InvalidRequest
from engine.disagg import DisaggEngine
from engine.handoff import HandoffError, HandoffHeader
from engine.kv_transfer import page_runs
from engine.kv_transfer.endpoint import Endpoint, room_echo
from engine.service.metrics import (
    KV_DESTINATION_RUNS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_FAILURES,
    KV_TRANSFER_SECONDS,
    KV_TRANSFER_SKIPPED_PAGES,
)
from engine.service import convert
from engine.service.grammar import attach_grammar
from engine.service.stream import RequestFailed, RequestStream
from decode_node.inflight import DecodeRequest, InFlight, Stage
from decode_node.peers import Peer, PeerError, PeerManager
from decode_node.completion import CompletionWaiter
from pdserve.v1 import kv_control_pb2 as kpb
from spec.draft_input import DisaggHandoffError
from spec.registry import AlgorithmBinding

log = logging.getLogger(__name__)
# Failure kinds (below) that are the prefill peer's doing: unreachable, its control RPC failed,
# no KV within the wait, or it reported the handoff failed. The router charges the prefill.
PREFILL_FAULTS = frozenset({"prefill_unreachable", "rpc_error", "waiting_timeout", "prefill_failed"})


@dataclass(frozen=True)
class DecodeTimeouts:
    prealloc_timeout: float = 30.0  # waiting for free pages / a handoff row
    waiting_timeout: float = DEFAULT_WAITING_TIMEOUT  # destination sent -> write completed


class DecodeHandler:
    def __init__(
        self,
        pd: DisaggEngine,
        endpoint: Endpoint,
        peers: PeerManager,
        waiter: CompletionWaiter,
        binding: AlgorithmBinding,
        timeouts: DecodeTimeouts,
        local_prefill: bool = True,
    ) -> None:
        self.pd, self.endpoint, self.peers, self.waiter = pd, endpoint, peers, waiter
        self.binding, self.timeouts, self.local_prefill = binding, timeouts, local_prefill
        self.pending = InFlight(pd, endpoint.rows, waiter, quarantine_s=timeouts.waiting_timeout)
        self._aborting: set[asyncio.Future[None]] = set()  # AbortRoom calls under way

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        pd = self.pd
        params = convert.sampling_params(request, pd.max_context_len)
        req = pd.make_request(list(request.tokenized.input_ids), params, request.request_id or None)
        # Its own matcher, fresh: adoption replays the prefill's first token into it exactly once
        # (Scheduler.adopt_prebuilt appends it like any sampled token). A grammar this side cannot
        # build fails here, before any KV is reserved.
        await attach_grammar(pd, req)
        dp = request.disaggregated_params
        stream = RequestStream(pd, req, request.stream, pd.tokenizer, pd.eos_token_ids)
        if not dp.bootstrap_host:  # local prefill: the engine runs the prompt between decode steps
            if not self.local_prefill:
                raise RequestFailed.refused_alone("decode", "run prompts", "--local-prefill-tpot-ms")
            self.pending.begin_local(req)
            pd.submit(req, stream.on_update)
            async for resp in stream.responses():
                yield resp
            return
        if self.pending.room_in_use(dp.bootstrap_room):
            raise InvalidRequest(f"bootstrap_room {dp.bootstrap_room} is already in use on this decode node")
        dr = self.pending.begin(req, dp.bootstrap_room)
        bootstrap = (dp.bootstrap_host, dp.bootstrap_port or DEFAULT_BOOTSTRAP_PORT)
        try:
            dr.peer = await self.peers.get(*bootstrap)
            await self._reserve(dr)
            header, state = await self._receive(dr)
            await self._adopt(dr, header, state, stream)
        except (PeerError, RequestFailed, asyncio.TimeoutError, grpc.aio.AioRpcError) as e:
            kind = _kind(e)
            KV_TRANSFER_FAILURES.labels("decode", kind).inc()
            self._give_up(dr, _reason(e), bootstrap)
            raise RequestFailed(
                f"decode could not start room {dr.room}: {_reason(e)}",
                kind,
                blame="prefill" if kind in PREFILL_FAULTS else None,
            ) from None
        except BaseException:  # cancelled by the client (at any await): free what it holds
            self._give_up(dr, "cancelled", bootstrap)
            raise
        async for resp in stream.responses():
            yield resp

    async def _reserve(self, dr: DecodeRequest) -> None:
        """A handoff row, a slot and pages for the prompt; waits (bounded) for capacity."""
        rows, req = self.endpoint.rows, dr.req
        deadline = time.monotonic() + self.timeouts.prealloc_timeout
        while True:
            _check_aborted(dr)
            dr.row = rows.alloc()
            if dr.row is not None:
                dr.destination = await asyncio.wrap_future(self.pd.reserve_prompt(req))
                if dr.destination is not None:
                    dr.stage = Stage.RESERVED
                    return
                rows.free(dr.row)
                dr.row = None
            if time.monotonic() > deadline:
                raise RequestFailed(
                    f"no KV capacity for {len(req.prompt_ids)} prompt tokens "
                    f"within {self.timeouts.prealloc_timeout:.0f} s",
                    "no_capacity",
                )
            try:  # an abort ends the wait at once
                await asyncio.wait_for(dr.aborted.wait(), 0.01)
            except asyncio.TimeoutError:
                pass

    async def _receive(self, dr: DecodeRequest) -> tuple[HandoffHeader, Any]:
        req, room, peer = dr.req, dr.room, dr.peer
        assert dr.row is not None and dr.destination is not None
        pages, cached = dr.destination.pages, dr.destination.cached
        _check_aborted(dr)
        KV_DESTINATION_RUNS.observe(page_runs(pages[cached:]))
        done = self.waiter.expect(room, peer.agent)
        dr.stage = Stage.SENT  # from here a write may land in these pages: settle quarantines them
        try:
            ack = await peer.stub.SendDestination(
                kpb.DestinationRequest(
                    room=room,
                    request_id=req.rid,
                    decode_agent=self.endpoint.transport.name,
                    pages=pages,
                    aux_row=dr.row,
                    num_tokens=len(req.prompt_ids),
                    deadline_unix_s=time.time() + self.timeouts.waiting_timeout,
                    cached_pages=cached,
                ),
                timeout=self.peers.policy.rpc_timeout_s,
            )
            sent = time.perf_counter()
            if not ack.accepted:  # the prefill will never write here: the pages are free at once
                self.waiter.forget(room)
                dr.stage = Stage.RESERVED
                raise RequestFailed(f"prefill refused the destination: {ack.error}", "destination_refused")
            abort = asyncio.ensure_future(dr.aborted.wait())
            try:
                await asyncio.wait(
                    {done, abort}, timeout=self.timeouts.waiting_timeout, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                abort.cancel()
        except asyncio.TimeoutError:
            raise RequestFailed(
                f"no KV from the prefill within {self.timeouts.waiting_timeout:.0f} s", "waiting_timeout"
            ) from None
        _check_aborted(dr)
        if not done.done():
            raise RequestFailed(
                f"no KV from the prefill within {self.timeouts.waiting_timeout:.0f} s", "waiting_timeout"
            )
        kind, reason = done.result()
        waited = time.perf_counter() - sent
        KV_TRANSFER_SECONDS.labels("decode").observe(waited)
        if kind != "done":
            raise RequestFailed(
                f"prefill reported: {reason or kind}", "aborted" if kind == "abort" else "prefill_failed"
            )
        self.waiter.forget(room)
        dr.stage = Stage.COMMITTED  # the write is over: nothing else lands in these pages
        echo, payload = self.endpoint.rows.read(dr.row)
        self.endpoint.rows.free(dr.row)
        dr.row = None
        if echo != room_echo(room):  # a stale or foreign row: never commit it
            raise RequestFailed(f"handoff row echo {echo} does not match room {room}", "echo_mismatch")
        written = len(pages) - cached
        KV_TRANSFER_BYTES.labels("decode").inc(written * self.pd.kv_bytes_per_page + self.endpoint.rows.row_bytes)
        KV_TRANSFER_SKIPPED_PAGES.inc(cached)
        try:
            return self.pd.decode_handoff(payload)
        except HandoffError as e:
            raise RequestFailed(f"bad handoff row: {e}", "bad_handoff") from None

    async def _adopt(self, dr: DecodeRequest, header: HandoffHeader, state: Any, stream: RequestStream) -> None:
        """The request joins the running batch with its first token; the algorithm turns its
        handoff into its draft input, which the worker seeds its FutureMap rows from. A bad
        handoff fails this request only. Once queued, the adoption runs even if the client goes
        away meanwhile (the engine then aborts it): never a request the engine half-knows."""
        req = dr.req
        _check_aborted(dr)
        req.output_ids, req.seq_len, req.handoff = [header.first_token], len(req.prompt_ids), state
        if req.grammar is not None and req.grammar.validate([header.first_token]) != 1:  # checked, not taken
            raise RequestFailed(
                f"the prefill's first token {header.first_token} is outside this node's grammar "
                "(do both sides run the same tokenizer and --grammar-backend?)",
                "bad_handoff",
            )
        try:
            draft_input = self.binding.algorithm.build_disagg_draft_input(
                self.pd.prebuilt(req), self.binding.config, torch.tensor([header.first_token]), None
            )
        except (DisaggHandoffError, ValueError) as e:
            raise RequestFailed(f"bad handoff: {e}", "bad_handoff") from None
        self.pd.subscribe(req.rid, stream.on_update)
        fut = self.pd.adopt(req, draft_input, header)
        self.pending.handed_over(dr)
        await asyncio.shield(asyncio.wrap_future(fut))

    def _give_up(self, dr: DecodeRequest, reason: str, bootstrap: tuple[str, int]) -> None:
        """Free what the request holds and, unless its write already landed, tell the prefill
        (if connected) so its leg ends now too instead of at its own deadline. Pages a write may
        land in wait in quarantine for the prefill's answer (see decode_node/inflight.py)."""
        dr.abort_reason = dr.abort_reason or reason
        tell = dr.stage < Stage.COMMITTED
        self.pending.settle(dr)
        peer = dr.peer or self.peers.connected(*bootstrap)
        if tell and peer is not None and peer.alive:
            task = asyncio.ensure_future(self._abort_room(peer, dr.room, reason))
            self._aborting.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._aborting.discard)

    async def _abort_room(self, peer: Peer, room: int, reason: str) -> None:
        writes = await self.peers.abort_room(peer, room, reason)
        if writes == kpb.ROOM_WRITES_NONE_IN_FLIGHT:
            self.pending.writes_over(room, "the prefill has no write of the room in flight")

    def abort(self, request_id: str, reason: str) -> bool:
        """Wherever the request is: before its Generate, reserving, transferring, or in the engine."""
        self.pending.abort(request_id, reason)
        return True

    def inflight(self) -> int:
        return len(self.pending.live) + len(self.pending.quarantined)

    def stuck_reason(self) -> str | None:
        rows = self.endpoint.rows
        return f"all {rows.num_used} handoff rows are held with nothing in flight" if not rows.num_free else None

    def disaggregation_metrics(self) -> pb.DisaggregationMetrics:
        c = self.pending.counts()
        return pb.DisaggregationMetrics(
            mode="decode",
            decode_prealloc_queue_reqs=c["prealloc"],
            decode_transfer_queue_reqs=c["transfer"],
            # no kv_transfer_latency_ms: this side's wait (destination sent -> KV landed) holds the
            # prefill's queue and forward too; the prefill reports what the handoff adds
        )


def _check_aborted(dr: DecodeRequest) -> None:
    if dr.aborted.is_set():
        raise RequestFailed(dr.abort_reason or "aborted", "aborted")


def _kind(e: BaseException) -> str:
    if isinstance(e, RequestFailed):
        return e.kind
    if isinstance(e, PeerError):
        return "incompatible" if "incompatible" in str(e) else "prefill_unreachable"
    return "timeout" if isinstance(e, asyncio.TimeoutError) else "rpc_error"


def _reason(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e) or type(e).__name__
