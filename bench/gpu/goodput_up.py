"""One deployment under test: `pdserve up` as a subprocess (its URL and its nodes' /metrics URLs read
from what it prints), waiting until its nodes are idle, and stopping it with everything it started.

Both deployments start the same way and see every GPU (`--no-isolate-gpus`: PD's KV then moves
GPU to GPU through CUDA IPC, over NVLink where there is one); with `--device auto` on two GPUs,
PD puts the prefill on GPU 0 and the decode on GPU 1, and colocated one replica on each. Node
flags that `pdserve up` does not take itself (`--max-running`) reach the nodes as environment
variables (PDSERVE_<FLAG>), which the router has no use for.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Collection, Mapping, Sequence

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = {
    "pd": ("--prefill", "1", "--decode", "1", "--pd-prefill-policy", "auto"),
    "colocated": ("--colocated", "2"),
    "pd_remote": ("--prefill", "1", "--decode", "1", "--pd-prefill-policy", "remote"),
    "pd_pooled": ("--prefill", "1", "--decode", "1", "--pd-prefill-policy", "auto", "--pd-pooling", "auto"),
}
LABELS = {
    "pd": "PD 1P1D: prefill node on GPU 0, decode node on GPU 1; the router picks each prompt's node",
    "colocated": "two colocated replicas, one per GPU",
    "pd_remote": "PD 1P1D with every prompt on the prefill node",
    "pd_pooled": "PD 1P1D as pd, both nodes serving whole requests while the decode tier is the bottleneck",
}
NODES = {"pd": 2, "colocated": 2, "pd_remote": 2, "pd_pooled": 2}  # /metrics lines `pdserve up` prints
_UP = re.compile(r"^pdserve is up: (\S+)")
_METRICS = re.compile(r"^(\S+) metrics: (\S+)$")
# a request a node still holds: queued, running, or (PD) reserving or receiving KV
_BUSY = re.compile(
    r"^(?:pdserve_node_waiting_requests|pdserve_node_request_slots_used|pdserve_pd_queue_requests)"
    r"\{[^}]*\} ([0-9.eE+-]+)$",
    re.M,
)


def up_argv(deployment: str, model: Path, extra: Sequence[str] = ()) -> list[str]:
    """The `pdserve up` command line of a deployment (`extra`: speculative flags, --device)."""
    return [
        sys.executable,
        "-m",
        "pdserve.cli",
        "up",
        "--model",
        str(model),
        "--port",
        "0",
        "--no-isolate-gpus",
        "--verbose",
        *TOPOLOGIES[deployment],
        *extra,
    ]


class UpProcess:
    """A started `pdserve up`; `stop()` always runs (use it as a context manager)."""

    def __init__(
        self, deployment: str, argv: list[str], env: dict[str, str], log: Path, nodes: int | None = None
    ) -> None:
        self.deployment, self.argv, self.env, self.log_path = deployment, argv, env, log
        self.nodes = nodes if nodes is not None else NODES[deployment]  # /metrics lines to wait for
        self.url = ""
        self.metrics: dict[str, str] = {}
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log: IO[str] | None = None
        self._children: list[psutil.Process] = []  # router and nodes, as seen once it was up

    def __enter__(self) -> UpProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float) -> str:
        """Start it and wait (bounded) for its URL and every node's /metrics URL; returns the URL."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=REPO,  # nodes run `python -m pdserve.cli` from here
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=self._log,  # --verbose: every node's log, for a run that went wrong
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self.url or len(self.metrics) < self.nodes:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(f"`pdserve up` ({self.deployment}) did not come up:\n{self.log_tail()}")
            if m := _UP.match(line):
                self.url = m.group(1)
            elif m := _METRICS.match(line):
                self.metrics[m.group(1)] = m.group(2)
        self._children = _descendants(self.proc.pid)  # kept: if it dies, its children are orphans
        return self.url

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        if self._log is not None:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""

    def stop(self, grace_s: float = 60.0) -> None:
        """Ctrl-C, as a terminal sends it: `pdserve up` stops its router, then its nodes. Whatever
        is left after `grace_s` (it, or a child it lost track of) is killed by pid."""
        proc = self.proc
        if proc is None:
            return
        started = {c.pid: c for c in [*self._children, *_descendants(proc.pid)]}.values()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        _, alive = psutil.wait_procs(list(started), timeout=10)
        for child in alive:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


async def busy_requests(client: httpx.AsyncClient, metrics_urls: Sequence[str]) -> int:
    """Requests the nodes still hold, together, from their /metrics gauges (a request may count
    twice: what matters is whether this is zero)."""
    total = 0.0
    for url in metrics_urls:
        resp = await client.get(url)
        resp.raise_for_status()
        total += sum(float(v) for v in _BUSY.findall(resp.text))
    return int(total)


# what each node says of its load against capacity at a point's end (engine/service/metrics.py)
SIGNALS = (
    "pdserve_node_prompt_tokens_per_second",
    "pdserve_node_prefill_capacity_tokens_per_second",
    "pdserve_node_mixed_prefill_tokens_per_second",
    "pdserve_node_decode_tokens_per_second",
    "pdserve_node_decode_capacity_tokens_per_second",
)
TTFT_STAGES = "pdserve_router_ttft_stage_seconds"  # the router's time to first token by stage
ROUTER_TTFT = "pdserve_router_time_to_first_token_seconds"  # the whole, as the router sees it
PATH_DECISIONS = "pdserve_router_prefill_path_decisions_total"  # by reason (router/prefill_path.py)
PATH_ESTIMATES = "pdserve_router_prefill_path_estimate_seconds"  # each path's estimate when chosen
CALIBRATION = "pdserve_router_ttft_estimate_ratio"  # per node: observed over estimated TTFT
POOLED = "pdserve_router_pd_pooled"  # 1 while every PD node serves whole requests (router/pooling.py)
TIER_LOAD = "pdserve_router_tier_load"  # the recent load over capacity it decides on, by tier
_SAMPLE = re.compile(r"^(pdserve_\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$", re.M)


def samples(text: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample in a Prometheus exposition."""
    return [(m[1], m[2] or "", float(m[3])) for m in _SAMPLE.finditer(text)]


async def node_signals(client: httpx.AsyncClient, metrics: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per node, the load-against-capacity gauges now (the last 10 s for the rates)."""
    out: dict[str, dict[str, float]] = {}
    for node, url in metrics.items():
        try:
            resp = await client.get(url)
            resp.raise_for_status()
        except httpx.HTTPError:
            continue  # a node that does not answer now has no figures for this point
        found = {name.removeprefix("pdserve_node_"): v for name, _, v in samples(resp.text) if name in SIGNALS}
        out[node] = found
    return out


NODE_STAGES = (
    "pdserve_node_queue_time_seconds",  # admission wait
    "pdserve_node_prompt_seconds",  # admission to first token
    "pdserve_kv_handoff_tail_seconds",  # a prefill's last chunk computed -> final write done
    "pdserve_kv_handoff_stage_seconds",  # that tail by stage (handover includes a late destination)
    "pdserve_kv_transfer_seconds",  # prefill: final write posted -> done; decode: destination sent -> KV landed
)
# a decode's page runs per prompt written to it; a prefill's runs per write (both sides consecutive)
NODE_COUNTS = ("pdserve_kv_destination_runs", "pdserve_kv_write_runs")
# counted per point: forwards replayed or eager (by reason), decode steps that carried a chunk
NODE_COUNTERS = ("pdserve_node_graph_forwards_total", "pdserve_node_mixed_steps_total")


async def node_stage_totals(client: httpx.AsyncClient, metrics: dict[str, str]) -> dict[str, float]:
    """Every node's queue and prompt histogram totals, keyed `<node>:<sample>` (nodes that do not
    answer are left out); `node_stage_means_ms` of two of them gives a point's means."""
    out: dict[str, float] = {}
    for node, url in metrics.items():
        try:
            resp = await client.get(url)
            resp.raise_for_status()
        except httpx.HTTPError:
            continue
        out.update({f"{node}:{key}": v for key, v in histogram_totals(resp.text, NODE_STAGES + NODE_COUNTS).items()})
        out.update({f"{node}:{n}{{{labels}}}": v for n, labels, v in samples(resp.text) if n in NODE_COUNTERS})
    return out


def node_count_means(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per node, the mean observation of each of its NODE_COUNTS histograms between two snapshots
    of node_stage_totals (e.g. a decode's page runs per prompt), keyed less `pdserve_`."""
    out: dict[str, dict[str, float]] = {}
    for key, mean in histogram_means(before, after).items():
        node, _, sample = key.partition(":")
        name, _, labels = sample.partition("{")
        if name in NODE_COUNTS:
            short = name.removeprefix("pdserve_")
            out.setdefault(node, {})[f"{short}:{v}" if (v := label_values(labels)) else short] = mean
    return out


def label_values(labels: str) -> str:
    """A sample's non-empty label values beyond its node's own (role, node), comma-joined."""
    return ",".join(v for k, v in re.findall(r'(\w+)="([^"]*)"', labels) if v and k not in ("role", "node"))


def node_stage_means_ms(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per node, the mean milliseconds of each of its NODE_STAGES between two snapshots, keyed by
    the histogram's name less `pdserve_(node_)` and, for one labelled by more than its node,
    `:<label values>`."""
    out: dict[str, dict[str, float]] = {}
    for key, ms in histogram_means_ms(before, after).items():
        node, sample = key.split(":", 1)
        name, _, labels = sample.partition("{")
        values = label_values(labels)  # the node's own labels (role, node) say nothing the key does not
        stage = name.removeprefix("pdserve_node_").removeprefix("pdserve_")
        out.setdefault(node, {})[f"{stage}:{values}" if values else stage] = ms
    return out


def histogram_totals(text: str, names: Collection[str]) -> dict[str, float]:
    """The `_sum` and `_count` samples of the named histograms (`<name>_sum{labels}`: seconds)."""
    return {
        f"{name}{{{labels}}}": value
        for name, labels, value in samples(text)
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in names
    }


def histogram_means(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Mean observation of each histogram between two snapshots of histogram_totals, keyed by its
    `_sum` key less `_sum`; none where nothing was observed."""
    out = {}
    for key, total in after.items():
        if "_sum{" in key:
            count = key.replace("_sum{", "_count{")
            if (n := after.get(count, 0.0) - before.get(count, 0.0)) > 0:
                out[key.replace("_sum{", "{")] = (total - before.get(key, 0.0)) / n
    return out


def histogram_means_ms(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Mean milliseconds per observation of each `*_seconds` histogram between two snapshots of
    histogram_totals, keyed by name (less `_seconds`) and labels; none where nothing was observed."""
    return {
        key.replace("_seconds{", "{"): 1e3 * mean
        for key, mean in histogram_means(before, after).items()
        if "_seconds{" in key
    }


async def router_counters(client: httpx.AsyncClient, router_url: str) -> dict[str, float]:
    """The router's counters so far: requests by prefill path (`path:<name>`) and reason
    (`reason:<name>`), the TTFT stages' histogram totals (histogram_totals), and each node role's
    calibration (`calibration:<role>`); empty if it did not answer."""
    try:
        resp = await client.get(f"{router_url.rstrip('/')}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError:
        return {}
    counts = histogram_totals(resp.text, (TTFT_STAGES, ROUTER_TTFT, PATH_ESTIMATES))
    for name, labels, value in samples(resp.text):
        if name == "pdserve_router_prefill_path_total" and (path := re.search(r'path="([^"]*)"', labels)):
            counts[f"path:{path[1]}"] = value
        elif name == PATH_DECISIONS and (reason := re.search(r'reason="([^"]*)"', labels)):
            counts[f"reason:{reason[1]}"] = value
        elif name == CALIBRATION and (role := re.search(r'role="([^"]*)"', labels)):
            counts[f"calibration:{role[1]}"] = value  # a gauge: read at the point's end, not diffed
        elif name == POOLED:  # gauges too (router/pooling.py)
            counts["pool:pooled"] = value
        elif name == TIER_LOAD and (tier := re.search(r'tier="([^"]*)"', labels)):
            counts[f"pool:load_{tier[1]}"] = value
    return counts


def point_pool(after: dict[str, float]) -> dict[str, float]:
    """The router's mode (pooled 1, split 0) and the tiers' recent load at a point's end (router/pooling.py)."""
    return {k.removeprefix("pool:"): v for k, v in after.items() if k.startswith("pool:")}


def point_calibration(after: dict[str, float]) -> dict[str, float]:
    """Each node role's observed over estimated TTFT as the router read it at a point's end (one
    node per role here): a path estimate that misses a fixed cost shows as a ratio far from 1."""
    return {k.removeprefix("calibration:"): v for k, v in after.items() if k.startswith("calibration:")}


def point_decisions(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(path decisions by reason, mean estimated TTFT in ms of each path when chosen) between two
    router_counters snapshots: why the router sent prompts where it did."""
    reasons = {
        k.removeprefix("reason:"): n
        for k, v in after.items()
        if k.startswith("reason:") and (n := v - before.get(k, 0.0)) > 0
    }
    estimates: dict[str, float] = {}
    for key, ms in histogram_means_ms(before, after).items():
        if key.startswith(PATH_ESTIMATES.removesuffix("_seconds")) and (path := re.search(r'path="([^"]*)"', key)):
            estimates[path[1]] = ms
    return reasons, estimates


def point_counters(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(requests by path, mean TTFT stage in ms) between two router_counters snapshots; stage
    "router_total" is the router's whole TTFT (the client's, less HTTP and the client itself)."""
    paths = {k.removeprefix("path:"): v - before.get(k, 0.0) for k, v in after.items() if k.startswith("path:")}
    stages: dict[str, float] = {}
    for key, ms in histogram_means_ms(before, after).items():
        if stage := re.search(r'stage="([^"]*)"', key):
            stages[stage[1]] = ms
        elif key.startswith(ROUTER_TTFT.removesuffix("_seconds")):
            stages["router_total"] = ms
    return paths, stages


async def wait_idle(client: httpx.AsyncClient, metrics_urls: Sequence[str], timeout_s: float) -> bool:
    """Wait (bounded) until no node runs or queues a request: the next point then starts on an
    empty deployment, not behind the last one's cancelled backlog. False if it never emptied."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await busy_requests(client, metrics_urls) == 0:
                return True
        except httpx.HTTPError:
            pass  # a scrape that failed now says nothing; the deadline bounds the retries
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)


def node_env(
    max_running: int | None,
    mixed_chunk: bool = True,
    kv_write_sgl: str | None = None,
    switch_interval_ms: float | None = None,
) -> dict[str, str]:
    """The environment `pdserve up` and its children run in (flags `up` does not take, as the
    nodes' PDSERVE_* variables)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if max_running is not None:
        env["PDSERVE_MAX_RUNNING"] = str(max_running)  # the nodes' --max-running
    if not mixed_chunk:
        env["PDSERVE_DISABLE_MIXED_CHUNK"] = "true"  # the nodes' --disable-mixed-chunk
    if kv_write_sgl is not None:
        env["PDSERVE_KV_WRITE_SGL"] = kv_write_sgl  # the prefill nodes' --kv-write-sgl
    if switch_interval_ms is not None:
        env["PDSERVE_SWITCH_INTERVAL_MS"] = f"{switch_interval_ms:g}"  # every node's --switch-interval-ms
    return env
