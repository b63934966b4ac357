"""PD under faults: late and missing prefills, killed nodes, abort storms, mismatched pairs.
Every wait is bounded; every node is killed at the end; pools must end fully free."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from fixtures.pdkit import free_port, pd_generate, request, start_pair, stub, wait_idle
from fixtures.procs import Node

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")
IDS = [5, 17, 42, 7, 99, 3, 11, 250]


def _decode(model, *extra):
    return Node(["decode", "--model", str(model), "--port", "0", "--page-size", "4", *extra]).wait_ready(120)


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
    decode = _decode(tiny_llama_dir, "--connect-attempts", "30", "--connect-timeout", "60", "--kv-handoff-rows", "host")
    prefill = None
    try:
        d = stub(decode.ports["scheduler"])
        box: dict = {}
        req = request("late", IDS, 5, boot)
        t = threading.Thread(target=lambda: box.update(r=list(d.Generate(req, timeout=90))))
        t.start()
        time.sleep(2.0)  # the decode is retrying with backoff meanwhile
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
        d = stub(decode.ports["scheduler"])
        list(pd_generate(stub(prefill.ports["scheduler"]), d, request("warm", IDS, 8, boot))[0])
        box: dict = {}

        def orphan() -> None:  # the router's prefill leg never arrives: the decode waits for KV
            try:
                list(d.Generate(request("orphan", IDS, 9, boot), timeout=60))
            except grpc.RpcError as e:
                box["err"] = e

        t = threading.Thread(target=orphan)
        t.start()
        time.sleep(1.0)
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
        long_ids = list(range(1, 400))
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=pd_generate(p, d, request("k", long_ids, 10, boot), 30)))
        t.start()
        time.sleep(0.3)
        decode.kill()
        t.join(40)
        wait_idle(p, timeout=15)  # within the prefill's own deadlines
    finally:
        prefill.kill()
        decode.kill()


def test_random_aborts_of_many_requests_leave_both_pools_free(tiny_llama_dir):
    prefill, decode = start_pair(str(tiny_llama_dir), "--max-running", "16")
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        rng = random.Random(0)
        results = {"ok": 0, "err": 0}
        lock = threading.Lock()

        def one(i: int) -> None:
            ids = [rng.randrange(1, 500) for _ in range(rng.randrange(2, 40))]
            req = request(
                f"a{i}", ids, 1000 + i, boot, max_new=rng.randrange(1, 24), temperature=rng.choice([0.0, 1.0])
            )
            timer = threading.Timer(
                rng.uniform(0.0, 0.6),
                lambda: [
                    s.Abort(pb.AbortRequest(request_id=f"a{i}", reason="test"), timeout=10)
                    for s in rng.sample([p, d], rng.randrange(1, 3))
                ],
            )
            if rng.random() < 0.7:
                timer.start()
            t0 = time.monotonic()
            try:
                pd_generate(p, d, req, timeout=60)
                with lock:
                    results["ok"] += 1
            except grpc.RpcError:
                with lock:
                    results["err"] += 1
            finally:
                timer.cancel()
                with lock:
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
        wait_idle(p, timeout=40)
        wait_idle(d, timeout=40)
    finally:
        prefill.kill()
        decode.kill()


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
