"""PD under faults: late and missing prefills, killed nodes, abort storms, mismatched pairs.
Every wait is bounded (polled, never slept); every node is killed at the end; pools must end fully
free, and after aborts within a second."""

from __future__ import annotations

import random
import threading
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from fixtures.pdkit import (
    Legs,
    busy,
    free_port,
    load,
    local_request,
    pd_generate,
    request,
    start_pair,
    stub,
    wait_idle,
)
from fixtures.procs import Node
from fixtures.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
IDS = [5, 17, 42, 7, 99, 3, 11, 250]
FREE_AFTER_ABORT_S = 1.0  # an abort frees what it holds at once: no deadline is waited out


def _decode(model, *extra):
    return Node(["decode", "--model", str(model), "--port", "0", "--page-size", "4", *extra]).wait_ready(120)


def _failed_handshakes(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith('pdserve_bootstrap_attempts_total{result="failed"}')]
    return float(lines[0].split()[-1]) if lines else 0.0


def _transfers(node) -> int:
    """Decode requests whose destination went to the prefill (their pages may be written)."""
    return load(node).disaggregation.decode_transfer_queue_reqs


def _prefill(model, boot_port, *extra):
    return Node(
        [
            "prefill",
            "--model",
            str(model),
            "--port",
            "0",
            "--page-size",
            "4",
            "--bootstrap-port",
            str(boot_port),
            *extra,
        ]
    )


def test_decode_started_first_connects_when_the_prefill_comes_up(tiny_llama_dir):
    boot = free_port()
    # host rows on the decode, rows beside the KV on the prefill: each side's layout names its
    # rows' memory kind, so the two need not agree
    decode = _decode(
        tiny_llama_dir,
        "--connect-attempts",
        "30",
        "--connect-timeout",
        "60",
        "--kv-handoff-rows",
        "host",
        "--metrics-port",
        "0",
    )
    prefill = None
    try:
        d = stub(decode.ports["scheduler"])
        box: dict = {}
        req = request("late", IDS, 5, boot)
        t = threading.Thread(target=lambda: box.update(r=list(d.Generate(req, timeout=90))))
        t.start()
        # the prefill comes up only once the decode has tried and is retrying with backoff
        wait_until(lambda: _failed_handshakes(decode.ports["metrics"]), 60, "a failed handshake attempt")
        prefill = _prefill(tiny_llama_dir, boot).wait_ready(120)
        list(stub(prefill.ports["scheduler"]).Generate(req, timeout=60))
        t.join(90)
        assert len(box["r"][-1].complete.output_ids) == 16
        assert "connected to prefill" in "\n".join(decode.lines)
    finally:
        decode.kill()
        if prefill is not None:
            prefill.kill()


def test_decode_gives_up_on_a_prefill_that_never_answers(tiny_llama_dir):
    decode = _decode(tiny_llama_dir, "--connect-attempts", "3", "--connect-timeout", "5")
    try:
        d = stub(decode.ports["scheduler"])
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(d.Generate(request("nobody", IDS, 6, free_port()), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "unreachable after 3 attempts" in e.value.details()
        assert ("pdserve-blame", "prefill") in tuple(e.value.trailing_metadata())  # the router charges the prefill
        assert time.monotonic() - start < 15
        wait_idle(d)
    finally:
        decode.kill()


def test_mismatched_pair_is_refused_naming_the_field(tiny_llama_dir):
    boot = free_port()
    prefill = _prefill(tiny_llama_dir, boot).wait_ready(120)
    decode = Node(["decode", "--model", str(tiny_llama_dir), "--port", "0", "--page-size", "8"]).wait_ready(120)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(stub(decode.ports["scheduler"]).Generate(request("mm", IDS, 7, boot), timeout=30))
        assert "page_size differs" in e.value.details()
        wait_idle(stub(decode.ports["scheduler"]))
    finally:
        prefill.kill()
        decode.kill()


def test_killed_prefill_fails_the_decode_request_and_frees_its_reservation(tiny_llama_dir):
    boot = free_port()
    prefill = _prefill(tiny_llama_dir, boot).wait_ready(120)
    decode = _decode(tiny_llama_dir, "--heartbeat-interval", "0.5", "--waiting-timeout", "30")
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        list(pd_generate(p, d, request("warm", IDS, 8, boot))[0])
        box: dict = {}

        def orphan() -> None:  # the router's prefill leg never arrives: the decode waits for KV
            try:
                list(d.Generate(request("orphan", IDS, 9, boot), timeout=60))
            except grpc.RpcError as e:
                box["err"] = e

        t = threading.Thread(target=orphan)
        t.start()
        wait_until(lambda: _transfers(d), 30, "the orphan's destination sent to the prefill")
        # the prefill holds it (its ack may still be on the wire; a kill then fails the send, not the wait)
        wait_until(lambda: load(p).disaggregation.prefill_prealloc_queue_reqs, 30, "the destination at the prefill")
        time.sleep(0.5)
        prefill.kill()
        start = time.monotonic()
        t.join(30)
        assert box["err"].code() == grpc.StatusCode.UNAVAILABLE
        assert "heartbeats" in box["err"].details()
        assert time.monotonic() - start < 10  # heartbeats, not the 30 s waiting deadline
        wait_idle(d)
    finally:
        prefill.kill()
        decode.kill()


def test_killed_decode_lets_the_prefill_free_its_pages(tiny_llama_dir):
    boot = free_port()
    prefill = _prefill(tiny_llama_dir, boot, "--bootstrap-timeout", "3", "--transfer-timeout", "3").wait_ready(120)
    decode = _decode(tiny_llama_dir)
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        req = request("k", list(range(1, 400)), 10, boot)
        # the decode dies while the prefill, holding its destination, runs the prompt and writes
        decode_leg = Legs(req, decode=d, timeout=30)
        wait_until(lambda: load(p).disaggregation.prefill_prealloc_queue_reqs, 30, "the destination at the prefill")
        prefill_leg = Legs(req, prefill=p, timeout=30)
        decode.kill()
        prefill_leg.join(40)
        decode_leg.join(40)
        wait_idle(p, timeout=15)  # within the prefill's own deadlines
    finally:
        prefill.kill()
        decode.kill()


def test_random_aborts_of_many_requests_leave_both_pools_free(tiny_llama_dir):
    """Aborts at random moments of the handoff: Abort RPCs to either node or both, and clients
    that hang up (both calls cancelled, both nodes told), some before the prefill saw anything
    of the request; as a router that pools and splits again sends them, some requests take the
    local path (the decode node runs the prompt itself, between the others' decode steps) and
    some the whole path (the prefill node runs them from prompt to last token, beside the others'
    prompts). Both pools are free within a second of the last abort or request end."""
    whole = ("--local-decode-tpot-ms", "25")
    prefill, decode = start_pair(str(tiny_llama_dir), "--max-running", "16", prefill_extra=whole)
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        rng = random.Random(0)
        results = {"ok": 0, "err": 0}
        events: list[float] = []  # monotonic times of aborts and request ends
        lock = threading.Lock()

        def abort_rpcs(i: int) -> None:
            for s in rng.sample([p, d], rng.randrange(1, 3)):
                s.Abort(pb.AbortRequest(request_id=f"a{i}", reason="test"), timeout=10)
            with lock:
                events.append(time.monotonic())

        def hang_up(legs: Legs) -> None:
            legs.drop()
            with lock:
                events.append(time.monotonic())

        def one(i: int) -> None:
            ids = [rng.randrange(1, 500) for _ in range(rng.randrange(2, 40))]
            sampling = {"max_new": rng.randrange(1, 24), "temperature": rng.choice([0.0, 1.0])}
            t0 = time.monotonic()
            path = rng.random()
            if path < 0.25:  # the decode node runs the prompt itself (the router's local path)
                legs = Legs(local_request(f"a{i}", ids, **sampling), decode=d, timeout=60)
            elif path < 0.45:  # the prefill node runs it whole (the router's whole path)
                legs = Legs(local_request(f"a{i}", ids, **sampling), prefill=p, timeout=60)
            else:
                legs = Legs(request(f"a{i}", ids, 1000 + i, boot, **sampling), prefill=p, decode=d, timeout=60)
            if rng.random() < 0.3:  # the client hangs up, often before the prefill saw anything
                timer = threading.Timer(
                    rng.choice([0.0, rng.uniform(0.0, 0.04), rng.uniform(0.0, 0.6)]), hang_up, [legs]
                )
            else:
                timer = threading.Timer(rng.uniform(0.0, 0.6), abort_rpcs, [i])
            aborted = rng.random() < 0.7
            if aborted:
                timer.start()
            try:
                out = legs.join(60)
                streamed = out["d"] if "d" in out else out["p"]  # the leg the client reads
                with lock:
                    results["err" if isinstance(streamed, grpc.RpcError) else "ok"] += 1
            finally:
                timer.cancel()
                if aborted:  # an abort under way is over (and noted) before the request counts as ended
                    timer.join(10)
                with lock:
                    events.append(time.monotonic())
                    results.setdefault("slow", []).append(round(time.monotonic() - t0, 2))

        threads = []
        for i in range(220):
            threads.append(threading.Thread(target=one, args=(i,)))
            threads[-1].start()
            if len([t for t in threads if t.is_alive()]) >= 12:
                threads[-12].join(90)
        for t in threads:
            t.join(90)
        assert results["ok"] + results["err"] == 220
        # every request ends (success or error) well inside the nodes' deadlines: an abort on
        # either leg reaches the other side instead of leaving it to time out
        assert max(results["slow"]) < 10.0, sorted(results["slow"])[-5:]
        _assert_free_soon(p, d, max(events))
        wait_idle(p, timeout=40)
        wait_idle(d, timeout=40)
    finally:
        prefill.kill()
        decode.kill()


def _assert_free_soon(p, d, since: float) -> None:
    """Both pools free (nothing held, queued or in transfer) within FREE_AFTER_ABORT_S of `since`."""
    wait_until(
        lambda: (load(p), load(d)),
        since + FREE_AFTER_ABORT_S - time.monotonic(),
        f"both pools free within {FREE_AFTER_ABORT_S} s of the last abort",
        done=lambda loads: not any(busy(x) for x in loads),
    )


@pytest.mark.parametrize(
    "role, flag, value, choices",
    [("decode", "--kv-handoff-rows", "gpu", "kv, host"), ("prefill", "--kv-write-sgl", "always", "off, on, auto")],
)
def test_a_bad_kv_flag_value_is_a_clean_error_before_loading(tiny_llama_dir, role, flag, value, choices):
    import subprocess
    import sys

    from fixtures.procs import REPO

    res = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", role, "--model", str(tiny_llama_dir), "--port", "0", flag, value],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert f"{flag} must be one of {choices}, got '{value}'" in res.stderr
    assert "Traceback" not in res.stderr
    assert "loaded" not in res.stderr.lower()  # refused before the model loads


def test_a_bad_handoff_rows_place_is_refused_by_the_endpoint_too():
    from common.defaults import check_rows_place

    assert check_rows_place("host") == "host"
    with pytest.raises(ValueError, match="--kv-handoff-rows must be one of kv, host, got 'vram'"):
        check_rows_place("vram")
