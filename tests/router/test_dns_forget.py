"""DNS discovery forgets vanished pods (after their requests drained) and their metric series."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from router import nodes as nodes_mod
from router.metrics import DispatchMetrics
from router.nodes import DnsSource, NodeRegistry
from tests.router.fake_nodes import FakeNode


def test_vanished_addresses_are_forgotten_once_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        a, b = await FakeNode("decode").start(), await FakeNode("decode").start()
        listed = {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
        # What the headless service lists now: we play the DNS server.
        monkeypatch.setattr(nodes_mod, "resolve_headless", lambda name, port: sorted(listed))
        registry = NodeRegistry([], rpc_timeout_s=2.0, dns=[DnsSource("decode", "dec.svc", 1)])
        reg = CollectorRegistry()
        metrics = DispatchMetrics(reg)
        try:
            await registry.refresh_once()
            metrics.sync_nodes(registry.states)
            assert {s.address for s in registry.nodes("decode")} == listed
            b_addr = f"127.0.0.1:{b.port}"
            metrics.pairs.labels("-", b_addr).inc()
            registry.get(b_addr).inflight = 1  # a stream still runs on the draining pod
            listed.discard(b_addr)
            await registry.refresh_once()
            assert b_addr in {s.address for s in registry.states}  # kept while in use
            registry.get(b_addr).inflight = 0
            await registry.refresh_once()
            metrics.sync_nodes(registry.states)
            assert [s.address for s in registry.states] == [f"127.0.0.1:{a.port}"]
            assert reg.get_sample_value("pdserve_router_node_up", {"node": b_addr, "role": "decode"}) is None
            assert reg.get_sample_value("pdserve_router_breaker_state", {"node": b_addr, "role": "decode"}) is None
            assert (
                reg.get_sample_value("pdserve_router_pair_selections_total", {"prefill": "-", "decode": b_addr}) is None
            )
            assert (
                reg.get_sample_value("pdserve_router_node_up", {"node": f"127.0.0.1:{a.port}", "role": "decode"}) == 1
            )
            listed.add(b_addr)  # the pod comes back (or its IP is reused): known afresh
            await registry.refresh_once()
            assert b_addr in {s.address for s in registry.nodes("decode")}
        finally:
            await registry.stop()
            await a.stop()
            await b.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
