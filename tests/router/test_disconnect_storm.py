"""Clients that hang up at random moments, in bursts, through the router: afterwards both nodes hold
nothing (pages, admission slots, PD queues), read from their own state and from /metrics, stay
healthy, and serve a normal request. EAGLE and plain decoding, built-in pair, real processes."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from fixtures.pdkit import stub, wait_idle
from tests.router.stack import start_stack

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]
BURSTS, PER_BURST = 5, 36  # concurrency 36 per burst
MODES = ("before_headers", "after_headers", "mid_stream", "whole")


async def _client(port: int, body: bytes, mode: str, delay: float) -> str:
    """One streaming request over a raw socket, dropped as `mode` says; returns what it saw."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    try:
        if mode == "before_headers":
            await asyncio.sleep(delay)
            return "dropped"
        headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        if mode == "after_headers":
            return "dropped"
        events = 0
        while True:
            line = await asyncio.wait_for(reader.readline(), 60)
            if not line or line.startswith(b"data: [DONE]"):
                return "done" if line else "eof"
            if line.startswith(b"data: "):
                events += 1
                if mode == "mid_stream" and events >= 2:
                    return "dropped"
        return headers.decode()
    finally:
        writer.close()  # no graceful wait: the client is gone


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def _assert_nothing_held(node, role: str) -> None:
    load = wait_idle(stub(node.ports["scheduler"]), timeout=60)  # the node's own state
    assert load.num_used_tokens == 0 and load.num_running_reqs == 0, load
    port = node.ports["metrics"]
    for name in (
        "pdserve_kv_cache_used_tokens",
        "pdserve_node_request_slots_used",
        "pdserve_node_running_requests",
        "pdserve_pd_queue_requests",
    ):
        assert _metric(port, name) == 0, (role, name)
    health = stub(node.ports["scheduler"]).HealthCheck(pb.HealthCheckRequest(), timeout=10)
    assert health.healthy, (role, health.message)


@pytest.mark.parametrize("algorithm", ["EAGLE", "NONE"])
def test_disconnect_storm_leaves_nothing_behind(algorithm: str) -> None:
    stack = start_stack(
        None, decodes=1, node_args=("--speculative-algorithm", algorithm, "--metrics-port", "0", "--max-running", "24")
    )
    try:
        port, model = stack.router.ports["http"], stack.served_model
        rng = random.Random(7)

        async def storm() -> list[str]:
            seen: list[str] = []
            for _ in range(BURSTS):
                jobs = []
                for _ in range(PER_BURST):
                    body = json.dumps(
                        {
                            "model": model,
                            "prompt": f"def f{rng.randrange(1000)}(x):\n",
                            "max_tokens": rng.randrange(4, 48),
                            "stream": True,
                            "temperature": rng.choice([0.0, 1.0]),
                        }
                    ).encode()
                    mode = rng.choices(MODES, weights=(4, 2, 2, 1))[0]
                    jobs.append(_client(port, body, mode, rng.uniform(0.0, 0.6)))
                seen += await asyncio.gather(*jobs, return_exceptions=False)
            return seen

        seen = asyncio.run(storm())
        assert seen.count("dropped") > BURSTS * PER_BURST // 2
        time.sleep(1.0)
        _assert_nothing_held(stack.decodes[0], "decode")
        _assert_nothing_held(stack.prefill, "prefill")
        body = json.dumps({"model": model, "prompt": "import os\n", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{stack.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.load(r)["choices"][0]["finish_reason"] == "length"
    finally:
        stack.kill()
