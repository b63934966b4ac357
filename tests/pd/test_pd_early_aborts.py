"""Aborts that come before the prefill saw the request (its leg late, or never sent): both nodes
free what they hold within a second, and a request that comes after its abort is refused before
anything is computed or written."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from fixtures.pdkit import Legs, busy, load, request, start_pair, stub, wait_idle
from fixtures.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
IDS = [5, 17, 42, 7, 99, 3, 11, 250]
FREE_AFTER_ABORT_S = 1.0


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    prefill, decode = start_pair(str(tiny_llama_dir), "--max-running", "16")
    try:
        yield stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"]), prefill.ports["bootstrap"]
    finally:
        prefill.kill()
        decode.kill()


def _free_within(nodes, seconds: float, since: float) -> None:
    wait_until(
        lambda: [load(n) for n in nodes],
        since + seconds - time.monotonic(),
        f"pools free within {seconds} s of the abort",
        done=lambda loads: not any(busy(x) for x in loads),
    )


def test_a_destination_sent_for_a_prefill_leg_that_never_came_is_freed_at_once(pair):
    """The decode sent its destination; the prefill never saw the request. The prefill's answer
    to the room's abort (no write in flight, none to come) frees the pages, not a deadline."""
    p, d, boot = pair
    req = request("never-1", IDS, 501, boot)
    legs = Legs(req, decode=d)
    wait_until(lambda: load(d).disaggregation.decode_transfer_queue_reqs, 30, "the destination sent")
    assert load(d).num_used_tokens > 0
    legs.drop()
    dropped = time.monotonic()
    _free_within([d, p], FREE_AFTER_ABORT_S, dropped)
    assert legs.join(10)["d"].code() == grpc.StatusCode.CANCELLED
    # the prefill leg that comes late is refused before it computes anything
    with pytest.raises(grpc.RpcError) as e:
        list(p.Generate(req, timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "aborted before its request arrived" in e.value.details()
    wait_idle(p, timeout=5)


def test_an_abort_at_the_prefill_alone_before_its_leg_frees_the_decodes_destination(pair):
    """Only the prefill hears the abort, by id, while the decode already sent its destination and
    the prefill leg is still on its way. The late leg is refused and the decode told at once:
    it frees its pages instead of waiting out its own deadline."""
    p, d, boot = pair
    req = request("prefill-only-1", IDS, 503, boot)
    legs = Legs(req, decode=d)
    wait_until(lambda: load(d).disaggregation.decode_transfer_queue_reqs, 30, "the destination sent")
    p.Abort(pb.AbortRequest(request_id=req.request_id, reason="test"), timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        list(p.Generate(req, timeout=10))
    assert "aborted before its request arrived" in e.value.details()
    refused = time.monotonic()
    _free_within([d, p], FREE_AFTER_ABORT_S, refused)
    assert isinstance(legs.join(10)["d"], grpc.RpcError)  # the decode leg ends with the failure


def test_an_abort_by_id_before_either_leg_ends_both_on_arrival(pair):
    p, d, boot = pair
    for s in (p, d):
        s.Abort(pb.AbortRequest(request_id="early-1", reason="client went away"), timeout=10)
    out = Legs(request("early-1", IDS, 502, boot), prefill=p, decode=d).join(10)
    assert all(isinstance(out[k], grpc.RpcError) for k in ("p", "d"))
    assert "aborted before its request arrived" in out["p"].details()
    _free_within([p, d], FREE_AFTER_ABORT_S, time.monotonic())


@pytest.mark.parametrize("prefill_leg", [False, True], ids=["decode-leg-only", "both-legs"])
def test_clients_that_hang_up_right_after_sending_leave_nothing_held(pair, prefill_leg):
    """Bursts of requests dropped 0-40 ms after sending (the router cancels both calls and aborts
    both legs): whatever stage each reached, both pools are free within a second of the last."""
    p, d, boot = pair
    rng = random.Random(1 if prefill_leg else 2)
    last = 0.0
    for burst in range(4):
        legs = []
        for i in range(16):
            req = request(f"drop-{prefill_leg}-{burst}-{i}", IDS * 3, 600 + 16 * burst + i, boot)
            legs.append(Legs(req, prefill=p if prefill_leg else None, decode=d))
        drops = [threading.Timer(rng.uniform(0.0, 0.04), leg.drop) for leg in legs]
        for t in drops:
            t.start()
        for t in drops:
            t.join(10)
        last = time.monotonic()
        for leg in legs:
            leg.join(30)
    _free_within([p, d], FREE_AFTER_ABORT_S, last)
