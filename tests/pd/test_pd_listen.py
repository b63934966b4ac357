"""Nodes listen only where told: started with --host 127.0.0.1, every TCP or UDP socket a prefill
or decode node has bound for listening (gRPC, /metrics, UCX's own listeners under NIXL) is on a
loopback address, also after a request has moved KV between them. Read from /proc, bounded."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from engine.kv_transfer import nixl_available
from fixtures.pdkit import pd_generate, request, start_pair, stub

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
TCP_LISTEN = "0A"  # include/net/tcp_states.h


def _address(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/* writes an address as 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:[") : -1])
    return out


def listening(pid: int) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(protocol, address, port) of every TCP socket of `pid` in LISTEN and every UDP socket it
    has bound to a port."""
    inodes, found = _socket_inodes(pid), []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        table = Path(f"/proc/{pid}/net/{proto}")
        if not table.exists():  # no IPv6 in this kernel
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            hex_ip, hex_port = local.split(":")
            if inode not in inodes or int(hex_port, 16) == 0:
                continue
            if proto.startswith("tcp") and state != TCP_LISTEN:
                continue
            found.append((proto, _address(hex_ip), int(hex_port, 16)))
    return found


def _loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return (mapped or addr).is_loopback


def test_address_parsing() -> None:
    assert _address("0100007F") == ipaddress.ip_address("127.0.0.1")
    assert _address("0000000000000000FFFF00000100007F") == ipaddress.ip_address("::ffff:127.0.0.1")
    assert _address("00000000000000000000000001000000") == ipaddress.ip_address("::1")


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
