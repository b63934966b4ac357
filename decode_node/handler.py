"""Decode Generate: reserve pages + an aux row, send the destination, wait for the write,
check the room echo, rebuild the draft input, join the running batch and stream tokens."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import torch
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.core import Batch, ForwardMode, HandoffState, InvalidRequest, Req
from engine.kv_cache import OutOfPages
from engine.kv_transfer.endpoint import Endpoint, kv_pools, room_echo
from engine.service.metrics import KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES, KV_TRANSFER_SECONDS
from engine.service import convert
from engine.service.stream import RequestFailed, RequestStream
from engine.serving import EngineLoop
from decode_node.peers import PeerError, PeerManager
from decode_node.receiver import CompletionWaiter
from pdserve.v1 import kv_control_pb2 as kpb

log = logging.getLogger(__name__)
DEFAULT_BOOTSTRAP_PORT = 8998  # what SMG sends when the operator names no port
# Failure kinds (below) that are the prefill peer's doing: unreachable, its control RPC failed,
# no KV within the wait, or it reported the handoff failed. The router charges the prefill.
PREFILL_FAULTS = frozenset({"prefill_unreachable", "rpc_error", "waiting_timeout", "prefill_failed"})


@dataclass(frozen=True)
class DecodeTimeouts:
    prealloc_s: float = 30.0  # waiting for free pages / an aux row
    waiting_s: float = 60.0  # destination sent -> write completed


class DecodeHandler:
    def __init__(self, loop: EngineLoop, endpoint: Endpoint, peers: PeerManager, waiter: CompletionWaiter,
                 algorithm: Any, spec_config: Any, timeouts: DecodeTimeouts) -> None:
        self.loop, self.endpoint, self.peers, self.waiter = loop, endpoint, peers, waiter
        self.algorithm, self.spec_config, self.timeouts = algorithm, spec_config, timeouts
        self.engine = loop.engine
        self.eos = frozenset(self.engine.model_config.eos_token_ids)
        self.prealloc: set[str] = set()
        self.transferring: dict[str, int] = {}  # request id -> room
        self.aborted: dict[str, str] = {}  # aborts of requests not yet in the scheduler
        self._page_bytes = sum(p.page_bytes * p.num_layers * 2 for p in kv_pools(self.engine))

    async def generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        eng = self.engine
        params = convert.sampling_params(request, eng.max_context_len)
        req = eng.make_request(list(request.tokenized.input_ids), params, request.request_id or None)
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
            record = await self._receive(req, room, peer, row)
        except (PeerError, RequestFailed, asyncio.TimeoutError, grpc.aio.AioRpcError) as e:
            kind = _kind(e)
            KV_TRANSFER_FAILURES.labels("decode", kind).inc()
            await self._give_up(req, room, row, peer, _reason(e))
            raise RequestFailed(f"decode could not start room {room}: {_reason(e)}", kind,
                                blame="prefill" if kind in PREFILL_FAULTS else None) from None
        except BaseException:  # cancelled by the client: free everything, tell the prefill
            await self._give_up(req, room, row, peer, "cancelled")
            raise
        stream = RequestStream(self.loop, req, request.stream, eng.tokenizer, self.eos)
        self.loop.io.subscribe(req.rid, stream.on_update)
        await asyncio.wrap_future(self.loop.call(lambda: self._adopt(req, record)))
        async for resp in stream.responses():
            yield resp

    async def _reserve(self, req: Req) -> int:
        """A slot and pages for the prompt, and an aux row; waits (bounded) for capacity."""
        aux = self.endpoint.aux
        deadline = time.monotonic() + self.timeouts.prealloc_s
        self.prealloc.add(req.rid)
        try:
            while True:
                row = aux.alloc()
                if row is not None:
                    ok = await asyncio.wrap_future(self.loop.call(lambda: self._reserve_kv(req)))
                    if ok:
                        return row
                    aux.free(row)
                if req.rid in self.aborted:
                    raise RequestFailed(self.aborted.pop(req.rid), "aborted")
                if time.monotonic() > deadline:
                    raise RequestFailed(f"no KV capacity for {len(req.prompt_ids)} prompt tokens within "
                                        f"{self.timeouts.prealloc_s:.0f} s", "no_capacity")
                await asyncio.sleep(0.01)
        finally:
            self.prealloc.discard(req.rid)

    def _reserve_kv(self, req: Req) -> bool:
        """Scheduler thread: admission by KV budget, like a prefill admission would."""
        kv = self.engine.kv
        need = len(req.prompt_ids) + self.engine.executor.kv_tokens_per_decode()
        if not kv.can_admit(need):
            return False
        kv.assign_slot(req)
        try:
            kv.reserve(req, len(req.prompt_ids))
        except OutOfPages:
            kv.release(req)
            return False
        return True

    async def _receive(self, req: Req, room: int, peer: Any, row: int) -> HandoffState:
        pages = await asyncio.wrap_future(self.loop.call(lambda: self.engine.kv.page_list(req)))
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
        rec = self.endpoint.aux.read(row)
        if rec.room != room_echo(room):  # a stale or foreign row: never commit it
            raise RequestFailed(f"aux row echo {rec.room} does not match room {room}", "echo_mismatch")
        self.endpoint.aux.free(row)
        KV_TRANSFER_BYTES.labels("decode").inc(len(pages) * self._page_bytes + self.endpoint.aux.row_bytes)
        return HandoffState(rec.first_token, rec.topk_p, rec.topk_index, rec.hidden)

    def _adopt(self, req: Req, handoff: HandoffState) -> None:
        """Scheduler thread: the request joins the running batch with its first token."""
        sched = self.engine.scheduler
        req.output_ids, req.seq_len, req.handoff = [handoff.first_token], len(req.prompt_ids), handoff
        updates = sched.adopt_prebuilt([req])
        if not req.finished:
            # seed the worker's FutureMap rows (publish + stash on the scheduler thread's stream,
            # so after any forward in flight) so the next decode resolves them like a colocated one
            future_map = getattr(self.engine.executor, "future_map", None)
            try:
                self.algorithm.build_disagg_draft_input(Batch(ForwardMode.PREBUILT, [req]), self.spec_config,
                                                        torch.tensor([handoff.first_token]), future_map)
            except ValueError as e:  # a bad handoff fails this request only
                updates.append(sched.fail(req, f"bad handoff: {e}"))
        self.engine.io.publish(updates)

    async def _give_up(self, req: Req, room: int, row: int | None, peer: Any, reason: str) -> None:
        self.aborted.pop(req.rid, None)
        self.loop.call(lambda: self.engine.kv.release(req))
        if row is not None:
            self.endpoint.aux.free(row)
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
        self.loop.abort(request_id, reason)
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
