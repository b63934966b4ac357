"""X-Request-Id across a real PD stack (router, prefill and decode processes on loopback, JSON logs):
the router echoes the id, and the router's and both nodes' log lines for the request carry it.
Every wait is bounded; every process is killed at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from engine.kv_transfer import nixl_available
from fixtures.procs import Node
from tests.router.stack import Stack, start_stack

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]

LOGS = ("--log-format", "json", "--log-level", "debug")


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    s = start_stack(str(tiny_llama_dir), decodes=1, node_args=LOGS, router_args=LOGS)
    try:
        yield s
    finally:
        s.kill()


def json_lines(node: Node) -> list[dict[str, Any]]:
    return [json.loads(line) for line in list(node.lines) if line.startswith("{")]


def wait_for_lines(
    node: Node, request_id: str, timeout: float = 10.0, until: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The node's log lines about `request_id` (or its retries), once there are some and one
    starts with each prefix in `until` (a process's output reaches us a little after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [x for x in json_lines(node) if x.get("request_id", "").split("-retry")[0] == request_id]
        done = found and all(any(x["message"].startswith(u) for x in found) for u in until)
        if done or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def completion(stack: Stack, headers: dict[str, str], stream: bool = False) -> httpx.Response:
    body = {"model": stack.served_model, "prompt": "def f(x):", "max_tokens": 4, "stream": stream}
    return httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_client_id_reaches_both_nodes_logs(stack: Stack, stream: bool) -> None:
    rid = f"client-trace-{int(stream)}"
    r = completion(stack, {"X-Request-Id": rid}, stream)
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    for node in (stack.prefill, stack.decodes[0]):
        lines = wait_for_lines(node, rid, until=("generate:", "complete:"))
        assert any(x["message"].startswith("generate:") for x in lines), json_lines(node)[-5:]
        assert any(x["message"].startswith("complete:") for x in lines)
        assert all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    router_lines = wait_for_lines(stack.router, rid, until=("POST /v1/completions -> 200",))
    assert any(x["message"].startswith("POST /v1/completions -> 200") for x in router_lines)


def test_without_a_client_id_the_router_makes_one_and_the_nodes_log_it(stack: Stack) -> None:
    r = completion(stack, {})
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and len(rid) == 32 and r.json()["id"] == f"cmpl-{rid}"
    assert wait_for_lines(stack.prefill, rid) and wait_for_lines(stack.decodes[0], rid)
