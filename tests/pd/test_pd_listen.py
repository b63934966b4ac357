"""Nodes listen only where told: started with --host 127.0.0.1, every TCP or UDP socket a prefill
or decode node has bound for listening (gRPC, /metrics, UCX's own listeners under NIXL) is on a
loopback address, also after a request has moved KV between them. Read with psutil, bounded."""

from __future__ import annotations

import ipaddress
import socket

import psutil
import pytest

from engine.kv_transfer import nixl_available
from fixtures.pdkit import pd_generate, request, start_pair, stub

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]


def listening(pid: int) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(protocol, address, port) of every TCP socket of `pid` in LISTEN and every UDP socket it
    has bound to a port."""
    found = []
    for conn in psutil.Process(pid).net_connections(kind="inet"):
        if not conn.laddr or not conn.laddr.port:
            continue
        if conn.type == socket.SOCK_STREAM and conn.status != psutil.CONN_LISTEN:
            continue
        proto = "tcp" if conn.type == socket.SOCK_STREAM else "udp"
        found.append((proto, ipaddress.ip_address(conn.laddr.ip.split("%", 1)[0]), conn.laddr.port))
    return found


def _loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return (mapped or addr).is_loopback


def test_nodes_started_on_loopback_listen_on_loopback_only(tiny_llama_dir) -> None:
    prefill, decode = start_pair(str(tiny_llama_dir), "--host", "127.0.0.1", "--metrics-port", "0")
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        out, _ = pd_generate(p, d, request("listen", [5, 17, 42, 7], 1, prefill.ports["bootstrap"]))
        assert out[-1].complete.output_ids  # UCX has connected the pair
        for node in (prefill, decode):
            sockets = listening(node.proc.pid)
            ports = {port for _, _, port in sockets}
            assert set(node.ports.values()) <= ports, (node.ports, sockets)  # what it announced, found
            assert len(sockets) > len(node.ports), sockets  # and UCX's own listener beside them
            assert all(_loopback(addr) for _, addr, _ in sockets), sockets
    finally:
        prefill.kill()
        decode.kill()
