"""DNS discovery of nodes behind a (headless-service-like) name; localhost stands in for it."""

from __future__ import annotations

import asyncio

import pytest

from router.nodes import DnsSource, NodeRegistry
from tests.router.fake_nodes import FakeNode


def test_dns_source_parsing():
    assert DnsSource.parse("prefill", "pf.svc:30001,8998") == DnsSource("prefill", "pf.svc", 30001, 8998)
    assert DnsSource.parse("decode", "dec.svc:30002") == DnsSource("decode", "dec.svc", 30002, None)
    with pytest.raises(ValueError, match="NAME:PORT"):
        DnsSource.parse("decode", "no-port")


def test_registry_discovers_nodes_behind_a_name_and_keeps_them_on_lookup_failure():
    async def run() -> None:
        node = await FakeNode("decode").start()
        registry = NodeRegistry(
            [],
            rpc_timeout_s=2.0,
            dns=[DnsSource("decode", "localhost", node.port), DnsSource("decode", "no-such-host.invalid", 1)],
        )
        try:
            await registry.refresh_once()
            healthy = [s.address for s in registry.nodes("decode")]
            assert healthy == [f"127.0.0.1:{node.port}"]  # (an ::1 entry, if any, fails health)
            known = len(registry.states)
            await registry.refresh_once()  # rediscovery adds nothing twice
            assert len(registry.states) == known
        finally:
            await registry.stop()
            await node.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
