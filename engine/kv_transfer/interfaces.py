"""Which network interfaces UCX may use, so its listeners follow the address a node was told to use.

UCX opens a listening TCP socket on every network interface its TCP transport uses (the peer's
endpoint connects to one of them), whatever address the node's gRPC servers are bound to. A node
started with `--host 127.0.0.1` must not listen on the machine's external interfaces, so UCX is
told to leave out every interface that does not hold the host's address (`UCX_NET_DEVICES=^...`).
Excluding rather than naming keeps RDMA devices (mlx5_0:1 and the like, not interfaces) usable:
they open no sockets. A wildcard host (0.0.0.0, ::) restricts nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import socket

log = logging.getLogger(__name__)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IFF_UP = 0x1  # <net/if.h>


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_uint8 * 14)]


class _SockaddrIn(ctypes.Structure):
    _fields_ = [
        ("sin_family", ctypes.c_ushort),
        ("sin_port", ctypes.c_uint16),
        ("sin_addr", ctypes.c_uint8 * 4),
        ("sin_zero", ctypes.c_uint8 * 8),
    ]


class _SockaddrIn6(ctypes.Structure):
    _fields_ = [
        ("sin6_family", ctypes.c_ushort),
        ("sin6_port", ctypes.c_uint16),
        ("sin6_flowinfo", ctypes.c_uint32),
        ("sin6_addr", ctypes.c_uint8 * 16),
        ("sin6_scope_id", ctypes.c_uint32),
    ]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_Sockaddr)),
    ("ifa_netmask", ctypes.POINTER(_Sockaddr)),
    ("ifa_ifu", ctypes.POINTER(_Sockaddr)),
    ("ifa_data", ctypes.c_void_p),
]


def interface_addresses() -> dict[str, set[IPAddress]]:
    """Every network interface that is up, with its IPv4/IPv6 addresses (getifaddrs(3))."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out: dict[str, set[IPAddress]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            up = bool(entry.ifa_flags & IFF_UP)  # UCX leaves down interfaces out itself
            addrs = out.setdefault(entry.ifa_name.decode(), set()) if up else set()
            if up and entry.ifa_addr:
                family = entry.ifa_addr.contents.sa_family
                if family == socket.AF_INET:
                    raw = ctypes.cast(entry.ifa_addr, ctypes.POINTER(_SockaddrIn)).contents.sin_addr
                    addrs.add(ipaddress.IPv4Address(bytes(raw)))
                elif family == socket.AF_INET6:
                    raw6 = ctypes.cast(entry.ifa_addr, ctypes.POINTER(_SockaddrIn6)).contents.sin6_addr
                    addrs.add(ipaddress.IPv6Address(bytes(raw6)))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


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
