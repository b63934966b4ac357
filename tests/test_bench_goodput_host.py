"""The goodput bench's own side of a point (bench/gpu/goodput_host.py): the host's TCP
retransmissions and softnet drops from /proc/net texts, and the client process's loop lag and CPU."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.gpu import goodput_host as host
from bench.gpu.goodput_run import draw_summary

SNMP = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 1000
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens RetransSegs InErrs
Tcp: 1 200 120000 -1 283038 14585 0
Udp: InDatagrams NoPorts
Udp: 5 6
"""

NETSTAT = """\
TcpExt: SyncookiesSent TCPLossProbes TCPTimeouts TCPSpuriousRTOs
TcpExt: 0 12 7 1
IpExt: InNoRoutes InTruncatedPkts
IpExt: 0 0
"""

SOFTNET = """\
0138b1cb 00000000 00000004 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000
013fbbd1 0000000a 00000003 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000001
"""


def _proc_net(root: Path, snmp: str = SNMP, netstat: str = NETSTAT, softnet: str = SOFTNET) -> Path:
    (root / "snmp").write_text(snmp)
    (root / "netstat").write_text(netstat)
    (root / "softnet_stat").write_text(softnet)
    return root


def test_proc_tables_pair_each_header_line_with_its_values() -> None:
    tcp = host.proc_table(SNMP, "Tcp")
    assert tcp["RetransSegs"] == 14585 and tcp["MaxConn"] == -1
    assert "InReceives" not in tcp  # another prefix's
    assert host.proc_table(NETSTAT, "TcpExt") == {
        "SyncookiesSent": 0,
        "TCPLossProbes": 12,
        "TCPTimeouts": 7,
        "TCPSpuriousRTOs": 1,
    }
    assert host.proc_table("", "Tcp") == {}


def test_softnet_totals_sum_the_hex_columns_over_cpus() -> None:
    assert host.softnet_totals(SOFTNET) == {"softnet_dropped": 10, "softnet_time_squeeze": 7}
    assert host.softnet_totals("") == {}


def test_a_points_host_net_is_the_growth_between_two_snapshots(tmp_path: Path) -> None:
    before = host.host_net(_proc_net(tmp_path))
    assert before == {
        "tcp_retrans_segs": 14585,
        "tcp_timeouts": 7,
        "tcp_loss_probes": 12,
        "tcp_spurious_rtos": 1,
        "softnet_dropped": 10,
        "softnet_time_squeeze": 7,
    }
    # one loopback segment lost: a tail-loss probe, then a resend after the 200 ms RTO
    after = host.host_net(
        _proc_net(
            tmp_path,
            snmp=SNMP.replace("14585", "14587"),
            netstat=NETSTAT.replace("0 12 7 1", "0 13 8 1"),
            softnet=SOFTNET.replace("0000000a", "0000000b"),
        )
    )
    assert host.host_net_deltas(before, after) == {
        "tcp_retrans_segs": 2,
        "tcp_timeouts": 1,
        "tcp_loss_probes": 1,
        "tcp_spurious_rtos": 0,
        "softnet_dropped": 1,
        "softnet_time_squeeze": 0,
    }


def test_counters_a_kernel_lacks_and_missing_files_are_left_out(tmp_path: Path) -> None:
    older = host.host_net(_proc_net(tmp_path, netstat="TcpExt: TCPTimeouts\nTcpExt: 3\n"))
    assert "tcp_loss_probes" not in older and older["tcp_timeouts"] == 3
    assert host.host_net(tmp_path / "absent") == {}  # no /proc: not Linux
    assert host.host_net_deltas({}, older) == {}
    assert isinstance(host.host_net(), dict)  # this machine's, whatever it has


def test_the_client_sampler_sees_its_loop_blocked() -> None:
    """A coroutine that blocks the loop 120 ms: one wake-up over 50 ms late, by about 100 ms."""

    async def blocked() -> dict[str, float]:
        load = host.ClientLoad.start()
        await asyncio.sleep(0.05)  # the sampler's first wake-ups, on time
        time.sleep(0.12)  # the point: a loop held by blocking work
        await asyncio.sleep(0.05)  # its late wake-up observed
        return await load.stop()

    start = time.monotonic()
    figures = asyncio.run(blocked())
    assert time.monotonic() - start < 2.0
    assert figures["loop_lags_over_50ms"] >= 1
    assert figures["loop_lag_ms_max"] >= 90.0
    assert 0.0 < figures["loop_lag_ms_mean"] < figures["loop_lag_ms_max"]
    assert 0.0 <= figures["cpu_cores"] <= 2.0  # a core busy most of the sleepless time at most


def test_the_client_sampler_counts_a_busy_core() -> None:
    """Busy-waiting the loop's thread is a core's worth of CPU."""

    async def busy() -> dict[str, float]:
        load = host.ClientLoad.start()
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            pass
        return await load.stop()

    assert asyncio.run(busy())["cpu_cores"] == pytest.approx(1.0, abs=0.35)


def test_a_draw_keeps_the_client_and_host_loads() -> None:
    entries = {"loose": {"requests": 3, "attainment": 1.0, "ttft_ms": {"p90": 1.0}, "tpot_ms": {"p50": 2.0}}}
    extra = {"client_load": {"cpu_cores": 0.4}, "host_net": {"tcp_retrans_segs": 2}}
    draw = draw_summary(7, entries, extra)
    assert draw["client_load"] == {"cpu_cores": 0.4} and draw["host_net"] == {"tcp_retrans_segs": 2}
    assert draw_summary(7, entries, {})["host_net"] == {}


def test_the_client_sampler_counts_full_collections_and_a_settled_heap_leaves_them_little() -> None:
    """A full collection while sampled is counted with its pause; inside settled_heap (what every
    point runs in) the objects alive before it are frozen out of collections, then thawed, and
    full collections are out of reach for the block and the thresholds back after it."""
    import gc

    from loadgen.heap import NO_FULL_COLLECTIONS, settled_heap

    async def collected() -> dict[str, float]:
        load = host.ClientLoad.start()
        gc.collect()
        return await load.stop()

    figures = asyncio.run(collected())
    assert figures["gc_full_collections"] >= 1 and figures["gc_pause_ms_max"] > 0.0
    assert figures["gc_pause_ms_total"] >= figures["gc_pause_ms_max"]
    assert not any(isinstance(c, host.GcPauses) for c in gc.callbacks)  # the tally is unhooked
    kept = [[i] for i in range(50_000)]  # live before the block: frozen inside it
    thresholds = gc.get_threshold()
    with settled_heap():
        assert gc.get_freeze_count() >= len(kept) and gc.get_threshold()[2] == NO_FULL_COLLECTIONS
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    with settled_heap():
        with settled_heap():  # nested: the outer block keeps the heap settled and thaws it
            assert gc.get_freeze_count() >= len(kept)
        assert gc.get_freeze_count() >= len(kept)  # (frozen objects may still die: the count only falls)
        assert gc.get_threshold()[2] == NO_FULL_COLLECTIONS
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


def test_a_point_that_allocates_many_containers_sets_off_no_full_collection_while_settled() -> None:
    """Freezing the old heap left a point's own objects to set off full collections; with them out
    of reach in the block it takes none, while young collections still free the cycles it drops."""
    import gc

    from loadgen.heap import GcPauses, settled_heap

    class Cycle:
        me: object = None

    with settled_heap():
        pauses = GcPauses().start()  # after the block's own settling collection, as in a point
        made = [{"chunk": [i]} for i in range(300_000)]  # a point's records
        for _ in range(50_000):
            c = Cycle()
            c.me = c  # dropped at once: only the collector frees it
        figures = pauses.stop()
        left = sum(1 for o in gc.get_objects() if type(o) is Cycle)
    assert figures["gc_full_collections"] == 0 and len(made) == 300_000
    assert left < 5_000  # young collections ran
