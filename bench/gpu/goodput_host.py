"""A goodput point on the bench's own host: the client's CPU, loop lag and GC pauses; the host's TCP losses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu.goodput_signals import LAG_OVER_S
from common.loop_lag import watch_loop_lag
from loadgen.heap import GcPauses

PROC_NET = Path("/proc/net")
# host_net key -> (file under /proc/net, line prefix, counter name). Every process of a deployment
# talks over 127.0.0.1, where a dropped segment is only resent after the minimum RTO (200 ms on
# Linux) and stalls every stream multiplexed on its connection meanwhile.
TCP_COUNTERS = {
    "tcp_retrans_segs": ("snmp", "Tcp", "RetransSegs"),
    "tcp_timeouts": ("netstat", "TcpExt", "TCPTimeouts"),  # retransmissions after a whole RTO
    "tcp_loss_probes": ("netstat", "TcpExt", "TCPLossProbes"),  # tail-loss probes, sent before an RTO
    "tcp_spurious_rtos": ("netstat", "TcpExt", "TCPSpuriousRTOs"),  # RTOs whose segment had arrived
}
# /proc/net/softnet_stat columns (hex, a line per CPU): a full backlog queue drops a loopback packet
# ("dropped"); a receive softirq out of budget or time with packets left is a "time_squeeze"
SOFTNET_COLUMNS = {"softnet_dropped": 1, "softnet_time_squeeze": 2}


def proc_table(text: str, prefix: str) -> dict[str, int]:
    """The `prefix:` counters of /proc/net/snmp or /proc/net/netstat, where each group is a line
    of names followed by a line of values, both starting with `prefix:`; name -> value."""
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith(f"{prefix}:")]
    out: dict[str, int] = {}
    for names, values in zip(rows[::2], rows[1::2]):
        for name, value in zip(names, values):
            with contextlib.suppress(ValueError):
                out[name] = int(value)
    return out


def softnet_totals(text: str) -> dict[str, int]:
    """SOFTNET_COLUMNS summed over the CPUs of a /proc/net/softnet_stat text."""
    out = dict.fromkeys(SOFTNET_COLUMNS, 0)
    for line in text.splitlines():
        cols = line.split()
        for key, col in SOFTNET_COLUMNS.items():
            if col < len(cols):
                with contextlib.suppress(ValueError):
                    out[key] += int(cols[col], 16)
    return out if text.strip() else {}


def _read(path: Path) -> str:
    """A file's text, or "" where it can't be read (no /proc: not Linux)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def host_net(proc_net: Path = PROC_NET) -> dict[str, int]:
    """A snapshot of the host's TCP_COUNTERS and softnet totals (cumulative since boot); the
    counters the kernel doesn't have, or the files there aren't, left out. /proc/net is this
    process's network namespace, which is the deployment's: its processes share the host's."""
    tables: dict[tuple[str, str], dict[str, int]] = {}
    out: dict[str, int] = {}
    for key, (file, prefix, name) in TCP_COUNTERS.items():
        if (file, prefix) not in tables:
            tables[file, prefix] = proc_table(_read(proc_net / file), prefix)
        if name in tables[file, prefix]:
            out[key] = tables[file, prefix][name]
    return {**out, **softnet_totals(_read(proc_net / "softnet_stat"))}


def host_net_deltas(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """How much each counter of two host_net snapshots grew: the point's, host-wide (any other
    process's traffic included; none is expected on a bench host)."""
    return {key: after[key] - before[key] for key in after if key in before}


@dataclass
class LagTally:
    """Loop-lag wake-ups folded as they come: how many, their sum and worst, and how many late."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    over: int = 0

    def observe(self, lag_s: float) -> None:
        self.count += 1
        self.total_s += lag_s
        self.max_s = max(self.max_s, lag_s)
        self.over += lag_s > LAG_OVER_S


def _cpu_s() -> float:
    """This process's CPU seconds, user and system over all its threads (os.times: no psutil)."""
    t = os.times()
    return t.user + t.system


@dataclass
class ClientLoad:
    """The bench process's own load over a point, in router_load's terms: a client whose loop or
    core is busy reads chunks late, which loadgen's records would show as the service's silence.
    Start it on the loop that runs loadgen; `stop()` gives the figures."""

    tally: LagTally = field(default_factory=LagTally)
    cpu_start_s: float = field(default_factory=_cpu_s)
    wall_start_s: float = field(default_factory=time.monotonic)
    gc_pauses: GcPauses = field(default_factory=lambda: GcPauses().start())
    task: asyncio.Task[None] | None = None

    @classmethod
    def start(cls) -> ClientLoad:
        load = cls()
        # the router's own sampler (common/loop_lag.py), observed here rather than into a histogram
        load.task = asyncio.get_running_loop().create_task(watch_loop_lag(load.tally.observe), name="client-lag")
        return load

    async def stop(self) -> dict[str, float]:
        """CPU cores used since start (1.0: a core the whole time), the loop lag's mean, worst and
        count of wake-ups over LAG_OVER_S (left out where the sampler never woke), and the garbage
        collector's full collections and pauses (a pause stalls the loop as long)."""
        cpu_s, wall_s = _cpu_s() - self.cpu_start_s, time.monotonic() - self.wall_start_s
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task})  # its end, without swallowing a cancellation of our own
        out: dict[str, float] = dict(self.gc_pauses.stop())
        if wall_s > 0:
            out["cpu_cores"] = cpu_s / wall_s
        if self.tally.count:
            out["loop_lag_ms_mean"] = self.tally.total_s / self.tally.count * 1e3
            out["loop_lag_ms_max"] = self.tally.max_s * 1e3
            out["loop_lags_over_50ms"] = self.tally.over
        return out
