"""engine.kv_transfer without a second process: handoff rows, KV regions and descriptors, and the
fake transport (the NIXL tests between two processes are in test_kv_transfer_nixl.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_transfer import (
    HandoffRows,
    KVPoll,
    TransferError,
    TransferRequest,
    coalesce_runs,
    create_transport,
    failure_tag,
    kv_regions,
    page_descs,
    page_runs,
    parse_tag,
    run_descs,
)
from tests.engine.kv_transfer_kit import SMALL, make_aux, make_pools, verify, write_aux_row


# ---- handoff rows ----------------------------------------------------------------------------


@pytest.mark.parametrize("payload_bytes", [0, 1, 56, 200, 4096 + 3])
def test_rows_round_trip(payload_bytes: int) -> None:
    buf = HandoffRows(payload_bytes, 4)
    assert buf.row_bytes % 64 == 0 and buf.row_bytes >= 8 + payload_bytes
    assert buf.region().item_bytes == buf.row_bytes and buf.region().count == 4
    row = buf.alloc()
    data = torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8)
    buf.write(row, 2**62 + 5, data)
    other = buf.alloc()
    buf.write(other, 9, data[: payload_bytes // 2].flip(0))  # a neighbouring row must not disturb this one
    echo, got = buf.read(row)
    assert echo == 2**62 + 5 and buf.room_of(row) == 2**62 + 5 and torch.equal(got, data)
    short = buf.read(other)[1]
    assert torch.equal(short[: payload_bytes // 2], data[: payload_bytes // 2].flip(0))
    assert not bool(short[payload_bytes // 2 :].any())  # a short payload is zero-padded


def test_rows_rewrite_clears_the_longer_payload_before_it() -> None:
    """A row is written whole: a shorter payload leaves no byte of the previous one behind, and a
    read is a host copy that later writes do not change."""
    buf = HandoffRows(100, 3)
    row = buf.alloc()
    buf.write(row, 5, torch.full((100,), 7, dtype=torch.uint8))
    before = buf.read(row)[1]
    buf.write(row, 6, torch.full((10,), 3, dtype=torch.uint8))
    echo, after = buf.read(row)
    assert echo == 6 and after.device.type == "cpu"
    assert torch.equal(after[:10], torch.full((10,), 3, dtype=torch.uint8)) and not bool(after[10:].any())
    assert bool((before == 7).all())  # the earlier read is a copy


def test_rows_accounting_and_stale_rows() -> None:
    buf = HandoffRows(16, 4)
    rows = [buf.alloc() for _ in range(3)]
    assert rows == [1, 2, 3] and buf.alloc() is None and buf.num_free == 0
    buf.check()
    buf.write(2, 77, torch.ones(8, dtype=torch.uint8))
    buf.free(2)
    assert buf.room_of(2) == 0 and not bool(buf.tensor[2].any())  # echo zeroed: stale row fails
    with pytest.raises(RuntimeError):
        buf.free(2)
    buf.free(1)
    assert [buf.alloc(), buf.alloc()] == [2, 1]  # FIFO
    buf.check()
    with pytest.raises(IndexError):
        buf.write(0, 1, torch.zeros(1, dtype=torch.uint8))  # row 0 is reserved
    with pytest.raises(ValueError):
        buf.write(1, 0, torch.zeros(1, dtype=torch.uint8))  # room 0 means empty
    with pytest.raises(ValueError):
        buf.write(1, 3, torch.zeros(17, dtype=torch.uint8))  # does not fit
    with pytest.raises(ValueError):
        buf.write(1, 3, torch.zeros(2, dtype=torch.float32))  # bytes only


# ---- layouts --------------------------------------------------------------------------------


def test_kv_regions_and_descriptors() -> None:
    pools = make_pools(SMALL, fill=True)
    regions = kv_regions(pools)
    assert len(regions) == 2 * 2 * 2
    r = regions[3]  # pool 0, layer 1, v
    assert r.addr == pools[0].buffer[1, 1].data_ptr() and r.item_bytes == pools[0].page_bytes
    assert regions[4].item_bytes == pools[1].page_bytes and r.count == 12
    s, d, n = coalesce_runs([3, 4, 5, 9, 10], [7, 8, 2, 11, 12])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([3, 5, 9], [7, 2, 11], [2, 1, 2])
    ones = run_descs(regions, *coalesce_runs([1, 5], [1, 5])[0::2])
    assert [tuple(map(int, x)) for x in ones] == page_descs(regions, [1, 5])
    assert [page_runs(p) for p in ([], [4], [3, 4, 5], [7, 8, 2, 11, 12], [5, 4])] == [0, 1, 1, 3, 2]


# ---- fake transport -------------------------------------------------------------------------


def test_fake_transport_moves_pages_and_aux() -> None:
    spec = dict(SMALL)
    src_pools, dst_pools = make_pools(spec, fill=True), make_pools(spec, fill=False)
    src_aux, dst_aux = make_aux(spec), make_aux(spec)
    a = create_transport("fake", "fake-prefill", src_pools, src_aux)
    b = create_transport("fake", "fake-decode", dst_pools, dst_aux)
    try:
        peer = a.add_peer(b.metadata(), b.layout())
        assert b.add_peer(a.metadata(), a.layout()) == "fake-prefill"
        row = write_aux_row(spec, src_aux, 4242)
        cmd = {"room": 4242, "src_pages": [3, 4, 9], "dst_pages": [7, 8, 2], "dst_row": 5}
        h = a.write(TransferRequest(4242, peer, cmd["src_pages"], cmd["dst_pages"], row, 5))
        assert a.poll(h) == KVPoll.SUCCESS
        [(sender, msg)] = b.drain_notifications()
        assert sender == "fake-prefill" and parse_tag(msg) == ("done", 4242, "")
        assert verify(spec, dst_pools, dst_aux, cmd, set()) is None
        b.notify("fake-prefill", failure_tag(4242, "oom"))
        assert [parse_tag(m) for _, m in a.drain_notifications()] == [("fail", 4242, "oom")]
        a.fail_mode = "fail"
        assert a.poll(a.write(TransferRequest(1, peer, [1], [1], row, 1))) == KVPoll.FAILED
        a.fail_mode = "raise"
        with pytest.raises(TransferError):
            a.write(TransferRequest(1, peer, [1], [1], row, 1))
        bad = dataclasses.replace(b.layout(), aux=dataclasses.replace(b.layout().aux, item_bytes=64))
        with pytest.raises(TransferError, match="aux row size"):
            a.add_peer(b.metadata(), bad)
        with pytest.raises(ValueError, match="unknown transport"):
            create_transport("rdma", "x", [], src_aux)
    finally:
        a.close()
        b.close()


# ---- waiting on transfers -----------------------------------------------------------------------


def test_a_settled_transfer_costs_no_thread_round_trip() -> None:
    import asyncio
    import threading
    import time

    from engine.kv_transfer.waiting import wait_settled

    threads: list[str] = []

    def poll() -> KVPoll:
        threads.append(threading.current_thread().name)
        return KVPoll.SUCCESS

    state = asyncio.run(wait_settled(poll, time.monotonic() + 1.0))
    assert state is KVPoll.SUCCESS and threads == ["MainThread"]


def test_post_and_wait_posts_and_polls_in_one_poller_thread() -> None:
    """One round trip: the post and its polls run in the same poller thread; a post that
    raises hands its exception to the awaiter."""
    import asyncio
    import sys
    import threading

    from engine.kv_transfer.waiting import TIMER_SLACK_NS, post_and_wait

    seen: list[str] = []
    polls = iter([KVPoll.TRANSFERRING, KVPoll.TRANSFERRING, KVPoll.SUCCESS])

    def post() -> str:
        seen.append(threading.current_thread().name)
        return "handle"

    def poll(handle: str) -> KVPoll:
        seen.append(threading.current_thread().name)
        return next(polls)

    def broken() -> str:
        raise TransferError("refused")

    async def run() -> tuple[tuple[str, KVPoll], int]:
        # a long slice: a loaded machine's sleeps must not end the polling before SUCCESS
        result = await asyncio.wrap_future(post_and_wait(post, poll, 1e-5, slice_s=30.0))
        with pytest.raises(TransferError, match="refused"):
            await asyncio.wrap_future(post_and_wait(broken, poll))
        slack = await asyncio.wrap_future(post_and_wait(_timer_slack, lambda h: KVPoll.SUCCESS))
        return result, slack[0]

    result, slack = asyncio.run(run())
    assert result == ("handle", KVPoll.SUCCESS)
    assert len(seen) == 4 and len(set(seen)) == 1 and seen[0].startswith("pdserve-kv-poll")
    if sys.platform.startswith("linux"):
        assert slack == TIMER_SLACK_NS  # poller threads sleep as long as asked


def _timer_slack() -> int:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return -1
    return int(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK


def test_ucx_is_kept_off_every_interface_not_holding_the_host() -> None:
    """Excluded, not named: RDMA devices (not interfaces) stay usable; a wildcard host, or one
    on the only interface with an address, restricts nothing."""
    from ipaddress import ip_address as ip

    from engine.kv_transfer.interfaces import ucx_net_devices

    nics = {
        "lo": {ip("127.0.0.1"), ip("::1")},
        "eth0": {ip("192.0.2.2"), ip("fd00::2")},
        "eth1": {ip("198.51.100.7")},
        "ifb0": set(),  # up, no address: UCX has no use for it and warns when it is named
    }
    assert ucx_net_devices("127.0.0.1", nics) == "^eth0,eth1"
    assert ucx_net_devices("127.0.0.2", nics) == "^eth0,eth1"  # the loopback interface's too
    assert ucx_net_devices("::1", nics) == "^eth0,eth1"
    assert ucx_net_devices("192.0.2.2", nics) == "^eth1,lo"
    assert ucx_net_devices("fd00::2", nics) == "^eth1,lo"
    for anywhere in ("0.0.0.0", "::", ""):
        assert ucx_net_devices(anywhere, nics) is None
    assert ucx_net_devices("203.0.113.9", nics) is None  # nobody's: the node's own bind decides
    assert ucx_net_devices("127.0.0.1", {"lo": {ip("127.0.0.1")}}) is None


def test_this_machines_interfaces_include_loopback() -> None:
    from engine.kv_transfer.interfaces import interface_addresses

    found = interface_addresses()
    assert any(addr.is_loopback for addrs in found.values() for addr in addrs), found


def test_a_backend_gets_its_environment_for_its_creation_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from engine.kv_transfer.backend_env import NET_DEVICES_ENV, SGL_ENV, create_backend

    seen: dict[str, str | None] = {}

    class Agent:  # what NIXL reads while it creates the backend
        def create_backend(self, backend: str, params: dict[str, str]) -> None:
            seen.update({key: os.environ.get(key) for key in (SGL_ENV, NET_DEVICES_ENV)})

    monkeypatch.delenv(SGL_ENV, raising=False)
    monkeypatch.delenv(NET_DEVICES_ENV, raising=False)
    create_backend(Agent(), "UCX", {}, True, "^eth0")
    assert seen == {SGL_ENV: "1", NET_DEVICES_ENV: "^eth0"}
    assert SGL_ENV not in os.environ and NET_DEVICES_ENV not in os.environ
    monkeypatch.setenv(NET_DEVICES_ENV, "mlx5_0:1")  # an operator's own choice wins
    create_backend(Agent(), "UCX", {}, False, "^eth0")
    assert seen == {SGL_ENV: "0", NET_DEVICES_ENV: "mlx5_0:1"} and os.environ[NET_DEVICES_ENV] == "mlx5_0:1"
