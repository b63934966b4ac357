"""Decode Generate: reserve pages + a handoff row, send the destination, wait for the write,
check the room echo, rebuild the draft input, join the running batch and stream tokens."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import torch
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.core import InvalidRequest, Req
from engine.disagg import DisaggEngine
from engine.handoff import HandoffError, HandoffHeader
from engine.kv_transfer.endpoint import Endpoint, room_echo
from engine.service.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES, KV_TRANSFER_SECONDS
from engine.service import convert
from engine.service.stream import RequestFailed, RequestStream
from decode_node.peers import PeerError, PeerManager
from decode_node.receiver import CompletionWaiter
from pdserve.v1 import kv_control_pb2 as kpb
from spec.draft_input import DisaggHandoffError
from spec.registry import AlgorithmBinding

log = logging.getLogger(__name__)
DEFAULT_BOOTSTRAP_PORT = 8998  # what SMG sends when the operator names no port
# Failure kinds (below) that are the prefill peer's doing: unreachable, its control RPC failed,
# no KV within the wait, or it reported the handoff failed. The router charges the prefill.
PREFILL_FAULTS = frozenset({"prefill_unreachable", "rpc_error", "waiting_timeout", "prefill_failed"})


@dataclass(frozen=True)
class DecodeTimeouts:
    prealloc_s: float = 30.0  # waiting for free pages / a handoff row
    waiting_s: float = 60.0  # destination sent -> write completed


class DecodeHandler:
    def __init__(self, pd: DisaggEngine, endpoint: Endpoint, peers: PeerManager, waiter: CompletionWaiter,
                 binding: AlgorithmBinding, timeouts: DecodeTimeouts) -> None:
        self.pd, self.endpoint, self.peers, self.waiter = pd, endpoint, peers, waiter
        self.binding, self.timeouts = binding, timeouts
        self.prealloc: set[str] = set()
        self.transferring: dict[str, int] = {}  # request id -> room
        self.aborted: dict[str, str] = {}  # aborts of requests not yet in the scheduler

    async def generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        pd = self.pd
        params = convert.sampling_params(request, pd.max_context_len)
        req = pd.make_request(list(request.tokenized.input_ids), params, request.request_id or None)
        dp = request.disaggregated_params
        if not dp.bootstrap_host:
            raise InvalidRequest("a decode node needs disaggregated_params.bootstrap_host")
        room = dp.bootstrap_room
        if room in self.transferring.values():
            raise InvalidRequest(f"bootstrap_room {room} is already in use on this decode node")
        row, peer = None, None
        self.aborted.pop(req.rid, None)
        try:
            peer = await self.peers.get(dp.bootstrap_host, dp.bootstrap_port or DEFAULT_BOOTSTRAP_PORT)
            row = await self._reserve(req)
            header, state = await self._receive(req, room, peer, row)
        except (PeerError, RequestFailed, asyncio.TimeoutError, grpc.aio.AioRpcError) as e:
            kind = _kind(e)
            KV_TRANSFER_FAILURES.labels("decode", kind).inc()
            await self._give_up(req, room, row, peer, _reason(e))
            raise RequestFailed(f"decode could not start room {room}: {_reason(e)}", kind,
                                blame="prefill" if kind in PREFILL_FAULTS else None) from None
        except BaseException:  # cancelled by the client: free everything, tell the prefill
            await self._give_up(req, room, row, peer, "cancelled")
            raise
        stream = RequestStream(pd, req, request.stream, pd.tokenizer, pd.eos_token_ids)
        pd.subscribe(req.rid, stream.on_update)
        await asyncio.wrap_future(self._adopt(req, header, state))
        async for resp in stream.responses():
            yield resp

    async def _reserve(self, req: Req) -> int:
        """A slot and pages for the prompt, and a handoff row; waits (bounded) for capacity."""
        rows = self.endpoint.rows
        deadline = time.monotonic() + self.timeouts.prealloc_s
        self.prealloc.add(req.rid)
        try:
            while True:
                row = rows.alloc()
                if row is not None:
                    if await asyncio.wrap_future(self.pd.reserve_prompt(req)):
                        return row
                    rows.free(row)
                if req.rid in self.aborted:
                    raise RequestFailed(self.aborted.pop(req.rid), "aborted")
                if time.monotonic() > deadline:
                    raise RequestFailed(f"no KV capacity for {len(req.prompt_ids)} prompt tokens within "
                                        f"{self.timeouts.prealloc_s:.0f} s", "no_capacity")
                await asyncio.sleep(0.01)
        finally:
            self.prealloc.discard(req.rid)

    async def _receive(self, req: Req, room: int, peer: Any, row: int) -> tuple[HandoffHeader, Any]:
        pages = await asyncio.wrap_future(self.pd.page_list(req))
        done = self.waiter.expect(room, peer.agent)
        self.transferring[req.rid] = room
        try:
            ack = await peer.stub.SendDestination(kpb.DestinationRequest(
                room=room, request_id=req.rid, decode_agent=self.endpoint.transport.name, pages=pages,
                aux_row=row, num_tokens=len(req.prompt_ids),
                deadline_unix_s=time.time() + self.timeouts.waiting_s), timeout=self.peers.policy.rpc_timeout_s)
            sent = time.perf_counter()
            if not ack.accepted:
                raise RequestFailed(f"prefill refused the destination: {ack.error}", "destination_refused")
            kind, reason = await asyncio.wait_for(done, self.timeouts.waiting_s)
        except asyncio.TimeoutError:
            raise RequestFailed(f"no KV from the prefill within {self.timeouts.waiting_s:.0f} s",
                                "waiting_timeout") from None
        finally:
            self.waiter.forget(room)
            self.transferring.pop(req.rid, None)
        KV_TRANSFER_SECONDS.labels("decode").observe(time.perf_counter() - sent)
        if kind != "done":
            raise RequestFailed(f"prefill reported: {reason or kind}", "aborted" if kind == "abort" else "prefill_failed")
        echo, payload = self.endpoint.rows.read(row)
        if echo != room_echo(room):  # a stale or foreign row: never commit it
            raise RequestFailed(f"handoff row echo {echo} does not match room {room}", "echo_mismatch")
        self.endpoint.rows.free(row)
        KV_TRANSFER_BYTES.labels("decode").inc(len(pages) * self.pd.kv_bytes_per_page + self.endpoint.rows.row_bytes)
        try:
            return self.pd.decode_handoff(payload)
        except HandoffError as e:
            raise RequestFailed(f"bad handoff row: {e}", "bad_handoff") from None

    def _adopt(self, req: Req, header: HandoffHeader, state: Any) -> Future:
        """The request joins the running batch with its first token; the algorithm turns its
        handoff into its draft input, which the worker seeds its FutureMap rows from. A bad
        handoff fails this request only."""
        req.output_ids, req.seq_len, req.handoff = [header.first_token], len(req.prompt_ids), state
        try:
            draft_input = self.binding.algorithm.build_disagg_draft_input(
                self.pd.prebuilt(req), self.binding.config, torch.tensor([header.first_token]), None)
        except (DisaggHandoffError, ValueError) as e:
            return self.pd.fail(req, f"bad handoff: {e}")
        return self.pd.adopt(req, draft_input, header)

    async def _give_up(self, req: Req, room: int, row: int | None, peer: Any, reason: str) -> None:
        self.aborted.pop(req.rid, None)
        self.pd.release(req)
        if row is not None:
            self.endpoint.rows.free(row)
        if peer is not None and peer.alive:  # best effort: the prefill frees now, not at its deadline
            try:
                await peer.stub.AbortRoom(kpb.AbortRoomRequest(room=room, reason=reason[:200]), timeout=1.0)
            except Exception:  # noqa: BLE001 - an unreachable prefill has its own deadlines
                log.debug("AbortRoom for room %d failed", room, exc_info=True)

    def abort(self, request_id: str, reason: str) -> bool:
        """Wherever the request is: preallocating, transferring, or running in the engine."""
        room = self.transferring.get(request_id)
        if room is not None:
            self.waiter.resolve(room, "abort", reason)
        elif request_id in self.prealloc:
            self.aborted[request_id] = reason
        self.pd.abort(request_id, reason)
        return True

    def disaggregation_metrics(self) -> pb.DisaggregationMetrics:
        return pb.DisaggregationMetrics(mode="decode", decode_prealloc_queue_reqs=len(self.prealloc),
                                        decode_transfer_queue_reqs=len(self.transferring))


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
