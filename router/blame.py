"""Whose fault is a failed attempt: the prefill, the decode, or both.

The answer decides which nodes a job avoids on its retry, which breakers are charged, and the retry
reason on /metrics.

A leg's error is not always its own: a decode cannot start a room when its prefill is unreachable,
and a prefill's KV write fails when its decode died. So:
- a node may say in its gRPC trailing metadata (`pdserve-blame: prefill`) that its peer caused the
  failure (a decode whose prefill never answered, refused, or failed the handoff); it is believed;
- a prefill leg that fails while its decode does not answer a health check is the decode's fault;
- a stage timeout asks both legs for their health with a short deadline: a stopped or wedged
  process does not answer, and the silent ones are blamed. When both answer, a decode waiting on an
  unfinished prefill leg is most likely waiting for its KV, so the prefill is blamed.
"""

from __future__ import annotations

import asyncio

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from router.contract import DispatchError
from router.nodes import NodeState

# trailing metadata: the role of the node at fault ("prefill" | "decode"), as engine/service/servicer.py sends it
BLAME_KEY = "pdserve-blame"
# The request itself is bad: the same request fails on every pair, so no retry and no blame.
CLIENT_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})


class LegFailed(Exception):
    """An attempt failed; `blame` are the nodes it counts against, `error` what the client gets,
    `reason` the retry reason (a metric label: a short fixed string)."""

    def __init__(self, error: DispatchError, blame: tuple[NodeState, ...], reason: str, retryable: bool = True) -> None:
        super().__init__(error.message)
        self.error, self.blame, self.reason, self.retryable = error, blame, reason, retryable


def named_role(e: grpc.aio.AioRpcError) -> str | None:
    """The role a node's error says is at fault, from its trailing metadata."""
    for key, value in e.trailing_metadata() or ():
        if key == BLAME_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def rpc_failure(e: grpc.aio.AioRpcError, leg: str, node: NodeState, peer: NodeState | None = None) -> LegFailed:
    """A leg's RPC error; charged to `peer` instead when the node names the peer's role as at fault."""
    code = e.code()
    msg = f"{leg} node {node.address}: {code.name}: {e.details()}"
    if code in CLIENT_ERRORS:
        return LegFailed(DispatchError(400, msg, code="invalid_request"), (), "invalid", retryable=False)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return LegFailed(DispatchError(429, msg, code="overloaded", retry_after_s=1.0), (node,), "overloaded")
    status = 504 if code == grpc.StatusCode.DEADLINE_EXCEEDED else 502
    if peer is not None and named_role(e) == peer.role:
        return LegFailed(
            DispatchError(
                status, f"{peer.role} node {peer.address} failed its {leg} node ({msg})", code=f"{peer.role}_failed"
            ),
            (peer,),
            f"{peer.role}_failed",
        )
    return LegFailed(DispatchError(status, msg, code=f"{leg}_failed"), (node,), f"{leg}_failed")


async def answers(node: NodeState, timeout_s: float) -> bool:
    """Does the node answer a health check (healthy) within `timeout_s`?"""
    if node.stub is None:
        return False
    try:
        return bool((await node.stub.HealthCheck(pb.HealthCheckRequest(), timeout=timeout_s)).healthy)
    except grpc.aio.AioRpcError:
        return False


async def prefill_failure(failure: LegFailed, decode: NodeState, timeout_s: float) -> LegFailed:
    """A failed prefill leg, blamed on the decode when the decode does not answer (its KV write
    fails too when its decode died; blaming the prefill then would exclude it for the rest of the
    job, with one prefill leaving no retry on a healthy pair, and charge its breaker)."""
    if failure.reason != "prefill_failed" or await answers(decode, timeout_s):
        return failure
    msg = f"decode node {decode.address} is unreachable ({failure.error.message})"
    return LegFailed(DispatchError(502, msg, code="decode_failed"), (decode,), "decode_failed")


async def stage_timeout(
    prefill: NodeState | None, decode: NodeState, prefill_running: bool, waited_s: float, health_s: float
) -> LegFailed:
    """No decode message within `waited_s`: blame whichever legs do not answer a health check."""
    legs = [n for n in (prefill, decode) if n is not None]
    alive = await asyncio.gather(*(answers(n, health_s) for n in legs))
    silent = tuple(n for n, ok in zip(legs, alive) if not ok)
    if silent:
        why = " and ".join(f"{n.role} node {n.address}" for n in silent) + " did not answer a health check"
    else:
        silent = (prefill,) if prefill is not None and prefill_running else (decode,)
        why = f"{silent[0].role} node {silent[0].address} is the stage still running"
    reason = f"{silent[0].role}_timeout" if len(silent) == 1 else "pair_timeout"
    return LegFailed(DispatchError(504, f"no decode message within {waited_s:g} s; {why}", code=reason), silent, reason)
