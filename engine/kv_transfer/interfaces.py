"""Which network interfaces UCX may use, so its listeners follow the address a node was told to use.

UCX opens a listening TCP socket on every network interface its TCP transport uses (the peer's
endpoint connects to one of them), whatever address the node's gRPC servers are bound to. A node
started with `--host 127.0.0.1` must not listen on the machine's external interfaces, so UCX is
told to leave out every interface that does not hold the host's address (`UCX_NET_DEVICES=^...`).
Excluding rather than naming keeps RDMA devices (mlx5_0:1 and the like, not interfaces) usable:
they open no sockets. A wildcard host (0.0.0.0, ::) restricts nothing.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

import psutil

log = logging.getLogger(__name__)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def interface_addresses() -> dict[str, set[IPAddress]]:
    """Every network interface that is up, with its IPv4/IPv6 addresses (UCX leaves down ones out
    itself)."""
    stats = psutil.net_if_stats()
    return {
        name: {
            ipaddress.ip_address(a.address.split("%", 1)[0])
            for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)
        }
        for name, addrs in psutil.net_if_addrs().items()
        if name in stats and stats[name].isup
    }


def host_addresses(host: str) -> set[IPAddress]:
    """What `host` (an address or a name) resolves to."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}


def ucx_net_devices(host: str, interfaces: dict[str, set[IPAddress]] | None = None) -> str | None:
    """UCX_NET_DEVICES that keeps UCX off every interface not holding `host`'s address, or None
    when nothing is to be left out (a wildcard host, a single interface, or a host no interface
    holds: then the node's own bind fails, or the operator knows better)."""
    wanted = host_addresses(host) if host else set()
    if not wanted or any(a.is_unspecified for a in wanted):
        return None
    interfaces = interface_addresses() if interfaces is None else interfaces
    # 127.0.0.2 is as much the loopback interface's as 127.0.0.1, which is all it lists
    holds = {
        name
        for name, addrs in interfaces.items()
        if addrs & wanted or (all(a.is_loopback for a in wanted) and any(a.is_loopback for a in addrs))
    }
    if not holds:
        log.warning("no network interface holds %s (%s); UCX may use them all", host, sorted(map(str, wanted)))
        return None
    # only interfaces UCX could open (up, with an address): naming others makes UCX warn
    others = sorted(name for name, addrs in interfaces.items() if addrs and name not in holds)
    return "^" + ",".join(others) if others else None
