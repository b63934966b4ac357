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
from typing import IO, Sequence

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = {
    "pd": ("--prefill", "1", "--decode", "1", "--pd-prefill-policy", "auto"),
    "colocated": ("--colocated", "2"),
    "pd_remote": ("--prefill", "1", "--decode", "1", "--pd-prefill-policy", "remote"),
    "pd_pooled": ("--prefill", "1", "--decode", "1", "--pd-prefill-policy", "auto", "--pd-pooling", "auto"),
    "pd_always_pooled": ("--prefill", "1", "--decode", "1", "--pd-prefill-policy", "auto", "--pd-pooling", "always"),
}
LABELS = {
    "pd": "PD 1P1D: prefill node on GPU 0, decode node on GPU 1; the router picks each prompt's node",
    "colocated": "two colocated replicas, one per GPU",
    "pd_remote": "PD 1P1D with every prompt on the prefill node",
    "pd_pooled": "PD 1P1D as pd, both nodes serving whole requests while the decode tier is the bottleneck",
    # what pooling is worth where the rule never engages it (the twenty-seventh run): an A/B, not a mode to run
    "pd_always_pooled": "PD 1P1D with both nodes always serving whole requests (--pd-pooling always)",
}
NODES = dict.fromkeys(TOPOLOGIES, 2)  # /metrics lines `pdserve up` prints: two nodes in every topology
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
    prompt_graph_tokens: int | None = None,
    stream_interval: int | str | None = None,
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
    if prompt_graph_tokens is not None:
        env["PDSERVE_CUDA_GRAPH_PROMPT_TOKENS"] = str(prompt_graph_tokens)  # every node's --cuda-graph-prompt-tokens
    if stream_interval is not None:
        env["PDSERVE_STREAM_INTERVAL"] = str(stream_interval)  # every node's --stream-interval
    return env
