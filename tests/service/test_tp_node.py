"""`pdserve serve --tp-size 2` as real processes on the CPU (gloo): it serves what a TP 1 node serves,
and when one of its ranks dies it turns NOT_SERVING within a bound while a router in front fails
over to a healthy node. Prefill and decode nodes refuse TP > 1. One set of processes, every wait
bounded, everything started is killed."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterator

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from fixtures.procs import Node
from fixtures.waiting import wait_until

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
READY_S = 180.0  # a TP 2 node spawns a second torch process and loads twice on a small CPU
NOT_SERVING_S = 10.0  # the rank watch sees the exit at once; health publishes each second


def _serve(tp: int) -> Node:
    # the built-in pair (EAGLE on, fp32 on a CPU); small KV so both nodes start fast
    return Node(["serve", "--device", "cpu", "--port", "0", "--max-total-tokens", "2048", "--tp-size", str(tp)])


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[int, Node]]:
    started = {2: _serve(2), 1: _serve(1)}  # loading side by side
    try:
        for n in started.values():
            n.wait_ready(READY_S)
        yield started
    finally:
        for n in started.values():
            n.kill()


def _stub(node: Node) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(f"127.0.0.1:{node.ports['scheduler']}"))


def _greedy(node: Node, rid: str) -> list[int]:
    params = pb.SamplingParams(temperature=0.0, max_new_tokens=16)
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=params)
    [resp] = list(_stub(node).Generate(req, timeout=60))
    return list(resp.complete.output_ids)


def _health(node: Node) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{node.ports['scheduler']}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _followers(node: Node) -> list[psutil.Process]:
    """The node's rank processes (multiprocessing spawns them; its resource tracker is not one)."""
    kids = psutil.Process(node.proc.pid).children()
    return [p for p in kids if "spawn_main" in " ".join(p.cmdline())]


def test_tp2_node_serves_what_a_tp1_node_serves(nodes: dict[int, Node]) -> None:
    assert len(_followers(nodes[2])) == 1 and _followers(nodes[1]) == []
    args = _stub(nodes[2]).GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args
    assert args["tp_size"] == 2
    want = _greedy(nodes[1], "tp1")
    assert len(want) == 16
    assert _greedy(nodes[2], "tp2") == want


def _completion(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_a_dead_rank_makes_the_node_not_serving_and_the_router_fails_over(nodes: dict[int, Node]) -> None:
    tp2, tp1 = nodes[2], nodes[1]
    colocated = [arg for n in (tp2, tp1) for arg in ("--colocated", f"127.0.0.1:{n.ports['scheduler']}")]
    router = Node(["router", "--port", "0", "--refresh-interval", "0.5", *colocated])
    try:
        url = f"http://127.0.0.1:{router.wait_ready(60).ports['http']}"
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        before = [_completion(url, model) for _ in range(4)]
        assert all(r.status_code == 200 for r in before), [r.text for r in before]

        [rank1] = _followers(tp2)
        rank1.kill()
        killed = time.monotonic()
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: _health(tp2), NOT_SERVING_S, "TP 2 node NOT_SERVING", done=lambda s: s == not_serving)
        print(f"NOT_SERVING {time.monotonic() - killed:.2f} s after the rank died")
        check = _stub(tp2).HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert not check.healthy and "rank 1 exited" in check.message
        with pytest.raises(grpc.RpcError) as e:
            _greedy(tp2, "after-death")
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "rank 1 exited" in e.value.details()
        assert tp2.proc.poll() is None  # the node stays up to say so (probes restart it)
        assert _health(tp1) == health_pb2.HealthCheckResponse.SERVING

        after = [_completion(url, model) for _ in range(6)]
        assert all(r.status_code == 200 for r in after), [r.text for r in after]
    finally:
        router.kill()


def test_sigterm_stops_a_tp2_node_and_its_ranks() -> None:
    """SIGTERM to the node alone (as a container runtime sends it to PID 1): the node tells its rank
    to stop before it exits, so the rank never sees a broken group."""
    node = _serve(2).wait_ready(READY_S)
    try:
        kids = _followers(node)
        assert len(kids) == 1 and len(_greedy(node, "one")) == 16
        os.kill(node.proc.pid, signal.SIGTERM)
        assert node.proc.wait(30) == 0
        node._reader.join(10)
        _, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive, alive
        assert not [ln for ln in node.lines if "group broke" in ln or "Traceback" in ln], node.lines[-30:]
    finally:
        node.kill()
