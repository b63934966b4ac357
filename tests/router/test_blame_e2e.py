"""Blame on a real PD stack (one prefill, two decodes, the router; loopback, built-in pair): a stopped
decode is charged, not the prefill it was paired with; a stopped (then killed) prefill is charged,
not its healthy decodes. Read from the router's /metrics: the retry reason, the failures charged
per node and the breaker states. Every wait is bounded; every process is killed at the end.

The router refreshes node health only every 60 s here, so requests really reach the stopped node
(a refresh would otherwise mark it down first, and it would never be tried)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.kv_transfer import nixl_available
from router.breaker import BreakerState
from fixtures.procs import Node
from fixtures.waiting import wait_until
from tests.router.stack import Stack, start_stack

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]

OPEN, CLOSED = int(BreakerState.OPEN), int(BreakerState.CLOSED)  # the breaker gauge's values
FIRST_TOKEN_S = 8.0
COOLDOWN_S = 3.0
ROUTER_ARGS = (
    "--decode-policy",
    "round_robin",
    "--refresh-interval",
    "60",
    "--first-token-timeout",
    str(FIRST_TOKEN_S),
    "--breaker-cooldown",
    str(COOLDOWN_S),
)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(None, decodes=2, router_args=ROUTER_ARGS)
    try:
        yield s
    finally:
        for n in s.live_nodes():  # a stopped process must be continued to die cleanly
            os.killpg(n.proc.pid, signal.SIGCONT)
        s.kill()


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def _value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _charged(m: dict, node: Node, role: str) -> float:
    """Failures charged to a node's breaker, whatever the reason."""
    addr = f"127.0.0.1:{node.ports['scheduler']}"
    return sum(
        v
        for (name, labels), v in m.items()
        if name == "pdserve_router_node_failures_total" and ("node", addr) in labels and ("role", role) in labels
    )


def _breaker(m: dict, node: Node, role: str) -> float:
    return _value(m, "pdserve_router_breaker_state", node=f"127.0.0.1:{node.ports['scheduler']}", role=role)


def _retries(m: dict, prefix: str) -> float:
    return sum(
        v
        for (name, labels), v in m.items()
        if name == "pdserve_router_retries_total" and dict(labels)["reason"].startswith(prefix)
    )


def _post_many(stack: Stack, n: int) -> list[httpx.Response]:
    body: dict[str, Any] = {"model": stack.served_model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}

    def one(_: int) -> httpx.Response:
        return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=90)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _past_the_open_breaker(stack: Stack) -> Callable[[], httpx.Response | None]:
    """A request that reached a node, or None while the router had no pair to send it to."""

    def post() -> httpx.Response | None:
        body = {"model": "pycoder", "prompt": "x", "max_tokens": 2}
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
        return None if r.status_code == 503 and r.json()["error"]["code"] == "no_available_pair" else r

    return post


def test_a_stopped_decode_is_blamed_not_its_prefill(stack: Stack) -> None:
    stuck, healthy = stack.decodes
    before = _metrics(stack.url)
    os.killpg(stuck.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        results = _post_many(stack, 6)  # round robin: 3 first attempts on each decode
        took = time.monotonic() - started
    finally:
        os.killpg(stuck.proc.pid, signal.SIGCONT)
    # the 3 that met the stopped decode timed out, were blamed on it and retried on the other
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert FIRST_TOKEN_S <= took < FIRST_TOKEN_S + 30
    m = _metrics(stack.url)
    assert _retries(m, "decode_timeout") - _retries(before, "decode_timeout") == 3
    assert _retries(m, "prefill") == _retries(before, "prefill")
    assert _charged(m, stuck, "decode") - _charged(before, stuck, "decode") == 3
    assert _breaker(m, stuck, "decode") == OPEN
    assert _charged(m, stack.prefill, "prefill") == 0 and _breaker(m, stack.prefill, "prefill") == CLOSED
    assert _charged(m, healthy, "decode") == 0 and _breaker(m, healthy, "decode") == CLOSED


def test_a_stopped_then_killed_prefill_is_blamed_not_its_decodes(stack: Stack) -> None:
    prefill = stack.prefill
    before = _metrics(stack.url)
    os.killpg(prefill.proc.pid, signal.SIGSTOP)
    try:
        results = _post_many(stack, 3)
        # no other prefill: the error names it, and the client gets it (no retry on a pair without it)
        for r in results:
            assert r.status_code in (502, 504) and r.json()["error"]["code"].startswith("prefill_"), r.text
        m = _metrics(stack.url)
        assert _retries(m, "prefill_") - _retries(before, "prefill_") == 3
        assert _charged(m, prefill, "prefill") - _charged(before, prefill, "prefill") == 3
        assert _breaker(m, prefill, "prefill") == OPEN
        for d in stack.decodes:  # the decodes it was paired with are not charged for it
            assert _charged(m, d, "decode") == _charged(before, d, "decode")
        prefill.kill()  # now dead: refused connections instead of silence
    finally:
        if prefill.proc.poll() is None:
            os.killpg(prefill.proc.pid, signal.SIGCONT)
    # Open, the breaker leaves no pair (503 no_available_pair, nothing charged); after the cool-down
    # it is half-open and lets one request probe the prefill again.
    r = wait_until(_past_the_open_breaker(stack), COOLDOWN_S + 30, "the prefill's breaker to half-open", every=0.2)
    assert r.status_code in (502, 504) and r.json()["error"]["code"].startswith("prefill_"), r.text
    m2 = _metrics(stack.url)
    reasons = {dict(labels)["reason"]: v for (name, labels), v in m2.items() if name == "pdserve_router_retries_total"}
    print(f"retry reasons: {reasons}")
    assert _charged(m2, prefill, "prefill") == _charged(m, prefill, "prefill") + 1
    assert _breaker(m2, prefill, "prefill") == OPEN
    for d in stack.decodes:
        assert _charged(m2, d, "decode") == _charged(before, d, "decode")
