"""`pdserve up`: a whole local deployment (prefill and decode nodes + the router) in one command.

Children are real processes on 127.0.0.1 started through this same CLI; each prints a READY line
with its ports (every node serves /metrics on a port of its own). We wait (bounded) for every
READY, then for the router's /ready, print the nodes' metrics URLs, the URL and an example
request, and on Ctrl-C / SIGTERM stop everything: the router first, so it never sees its nodes go
away, then the nodes (SIGTERM, then SIGKILL past a grace period). Torch-free: the parent only
launches and watches.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from common.defaults import DEFAULT_MEM_FRACTION_STATIC


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    pumping: threading.Thread | None = None  # reads its output until it exits

    def pump(self, echo: bool) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if line.startswith("READY"):
                self.ports = {k: int(v.rsplit(":", 1)[1]) for k, v in re.findall(r"(\w+)=(\S+)", line)}
                self.ready.set()
            elif echo:
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class UpConfig:
    model: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    device: str = "auto"
    node_args: tuple[str, ...] = ()
    verbose: bool = False
    start_timeout_s: float = 300.0
    colocated: int = 0  # > 0: that many colocated nodes instead of prefill/decode (the PD baseline)
    # Each node sees only its own GPU (CUDA_VISIBLE_DEVICES). Off: every node sees every GPU and
    # gets `--device cuda:N`, which NIXL needs for GPU-to-GPU copies over NVLink (CUDA IPC).
    isolate_gpus: bool = True
    log_args: tuple[str, ...] = ()  # --log-level/--log-format for every child, router included
    pd_prefill_policy: str = "remote"  # the router's --pd-prefill-policy (PD only)
    pd_pooling: str = "off"  # the router's --pd-pooling (PD only)
    # Tensor-parallel ranks per node: node k's ranks on GPUs k*tp_size .. k*tp_size + tp_size - 1
    tp_size: int = 1
    decode_args: tuple[str, ...] = ()  # flags for decode nodes only (e.g. --local-prefill-tpot-ms)
    prefill_args: tuple[str, ...] = ()  # flags for prefill nodes only (e.g. --local-decode-tpot-ms)
    router_args: tuple[str, ...] = ()  # flags for the router only (e.g. --pd-mixed-remote-ttft-target-ms)


class Deployment:
    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []

    def _spawn(self, name: str, args: list[str], device: str | None = None) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "WARN"}
        if device is not None and device.startswith("cuda:") and self.cfg.isolate_gpus:
            # each node sees only its own GPUs, its first as cuda:0
            env["CUDA_VISIBLE_DEVICES"] = _visible(device, self.cfg.tp_size)
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *args],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        child = Child(name, proc)
        child.pumping = threading.Thread(target=child.pump, args=(self.cfg.verbose,), daemon=True)
        child.pumping.start()
        self.children.append(child)
        return child

    def _wait_ready(self, child: Child, deadline: float) -> None:
        while not child.ready.wait(0.2):
            if child.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(child.lines[-20:])
                raise RuntimeError(f"{child.name} did not start:\n{tail}")

    def start(self, progress: Callable[[str], None]) -> str:
        """Start every node, then the router; wait for its /ready and return its URL."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.start_timeout_s
        model = ["--model", cfg.model] if cfg.model else []
        # every node serves /metrics (any free port, named on its READY line) for its KV and queue gauges
        common = [*model, "--host", cfg.host, "--port", "0", "--metrics-port", "0", *cfg.node_args, *cfg.log_args]
        if cfg.tp_size > 1:
            common += ["--tp-size", str(cfg.tp_size)]
        plans = self._colocated_plans(common) if cfg.colocated else self._pd_plans(common)
        nodes = []
        for wave in _waves(plans, sizes_kv_itself=_sizes_kv_itself(cfg.node_args)):
            started = [self._spawn(name, args, dev) for name, args, dev in wave]
            for n in started:
                progress(f"loading {n.name}")
                self._wait_ready(n, deadline)
            nodes += started
        router_args = ["router", "--host", cfg.host, "--port", str(cfg.port), *cfg.log_args]
        if not cfg.colocated:
            router_args += ["--pd-prefill-policy", cfg.pd_prefill_policy, "--pd-pooling", cfg.pd_pooling]
            router_args += cfg.router_args
        for n in nodes:
            if n.name.startswith("prefill"):
                router_args += ["--prefill", f"{cfg.host}:{n.ports['scheduler']},{n.ports['bootstrap']}"]
            elif n.name.startswith("decode"):
                router_args += ["--decode", f"{cfg.host}:{n.ports['scheduler']}"]
            else:
                router_args += ["--colocated", f"{cfg.host}:{n.ports['scheduler']}"]
        router = self._spawn("router", router_args)
        progress("starting router")
        self._wait_ready(router, deadline)
        url = f"http://{cfg.host}:{router.ports['http']}"
        progress("waiting for a first completion (/ready)")
        _wait_http_ok(f"{url}/ready", deadline, router)
        return url

    def metrics_urls(self) -> dict[str, str]:
        """Each started node's /metrics URL, by node name."""
        host = self.cfg.host
        return {c.name: f"http://{host}:{c.ports['metrics']}/metrics" for c in self.children if "metrics" in c.ports}

    def _colocated_plans(self, common: list[str]) -> list[NodePlan]:
        devices = _devices(self.cfg.device, self.cfg.colocated, self.cfg.tp_size)
        return [
            (f"colocated-{i}", ["serve", *common, "--device", self._local(dev)], dev) for i, dev in enumerate(devices)
        ]

    def _pd_plans(self, common: list[str]) -> list[NodePlan]:
        cfg = self.cfg
        devices = _devices(cfg.device, cfg.prefill + cfg.decode, cfg.tp_size)
        plans: list[NodePlan] = [
            (
                f"prefill-{i}",
                ["prefill", *common, *self.cfg.prefill_args, "--bootstrap-port", "0"]
                + ["--device", self._local(devices[i])],
                devices[i],
            )
            for i in range(cfg.prefill)
        ]
        for i in range(cfg.decode):
            dev = devices[cfg.prefill + i]
            plans.append((f"decode-{i}", ["decode", *common, *self.cfg.decode_args, "--device", self._local(dev)], dev))
        return plans

    def _local(self, device: str) -> str:
        """The node's --device: cuda:0 of its one visible GPU, or the real index when all are visible."""
        return _local(device) if self.cfg.isolate_gpus else device

    def stop(self, grace_s: float = 10.0) -> None:
        """The router first (a router that outlives a node reports it down and fails its
        requests), then every node; each group gets SIGTERM and `grace_s` before SIGKILL."""
        router = [c for c in self.children if c.name == "router"]
        _terminate(router, grace_s)
        _terminate([c for c in self.children if c not in router], grace_s)

    def watch(self, stop: threading.Event) -> str | None:
        """Block until `stop` or until a child dies; returns the dead child's name."""
        while not stop.wait(0.5):
            for c in self.children:
                if c.proc.poll() is not None:
                    return c.name
        return None


NodePlan = tuple[str, list[str], str]  # (name, CLI args, device)


def _terminate(children: list[Child], grace_s: float) -> None:
    """SIGTERM every child still running, then wait for them all; SIGKILL whoever outlives the grace
    (with its whole process group). SIGTERM goes to the child alone: a tensor-parallel node stops
    its rank processes itself, in order, and ranks signalled with it would die mid-conversation."""
    for c in children:
        if c.proc.poll() is None:
            os.kill(c.proc.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait(5)
        if c.pumping is not None:  # its last lines (how it stopped) are echoed before we go on
            c.pumping.join(max(0.1, end - time.monotonic()))


def _sizes_kv_itself(node_args: tuple[str, ...]) -> bool:
    """Did the operator size the KV cache (then nodes sharing a GPU are theirs to budget)?"""
    return any(a.split("=", 1)[0] in ("--max-total-tokens", "--mem-fraction-static") for a in node_args)


def _waves(plans: list[NodePlan], sizes_kv_itself: bool) -> list[list[NodePlan]]:
    """Start order: wave j holds the j-th node of every GPU, so nodes on different GPUs load at
    once and nodes sharing one load one after another (CPU nodes all load at once). A node sizes its
    KV cache from the memory left free when it starts (weights + KV may fill --mem-fraction-static
    of the GPU's total), so the j-th of k nodes on a GPU gets the cumulative share (j+1)/k of the
    default: each ends up with about 1/k of it, and none of them races another for the same free
    memory."""
    by_device: dict[str, list[NodePlan]] = {}
    for plan in plans:
        by_device.setdefault(plan[2], []).append(plan)
    waves: list[list[NodePlan]] = []
    for dev, group in by_device.items():
        k, gpu = len(group), dev.startswith("cuda")
        for j, (name, args, _) in enumerate(group):
            if k > 1 and gpu and not sizes_kv_itself:
                args = [*args, "--mem-fraction-static", f"{DEFAULT_MEM_FRACTION_STATIC * (j + 1) / k:.4f}"]
            wave = j if gpu else 0  # CPU nodes keep a fixed KV size: they all load at once
            while len(waves) <= wave:
                waves.append([])
            waves[wave].append((name, args, dev))
    return waves


def _devices(device: str, count: int, tp_size: int = 1) -> list[str]:
    """Each node's first device. One rank per node: nodes take GPUs in turn (sharing them when
    there are more nodes). Several: node k's ranks own GPUs k*tp_size .. k*tp_size + tp_size - 1,
    and a machine with fewer GPUs than ranks is refused (TpSetupError)."""
    if device == "auto":
        device = "cuda" if _cuda_count() > 0 else "cpu"
    if device == "cuda":
        n = _cuda_count()
        if tp_size > 1:
            from pdserve.tp import gpus_per_node

            gpus_per_node(tp_size, count, n)
            return [f"cuda:{k * tp_size}" for k in range(count)]
        return [f"cuda:{i % n}" for i in range(count)]
    return [device] * count


def _visible(device: str, tp_size: int) -> str:
    """CUDA_VISIBLE_DEVICES of a node whose first rank runs on `device` (cuda:i): i .. i+tp_size-1."""
    first = int(device.split(":", 1)[1])
    return ",".join(str(first + r) for r in range(tp_size))


def _cuda_count() -> int:
    """GPU count without importing torch in the parent (nvidia-smi, else none)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _local(device: str) -> str:
    return "cuda:0" if device.startswith("cuda:") else device


def _wait_http_ok(url: str, deadline: float, child: Child) -> None:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} never became ready:\n" + "\n".join(child.lines[-20:]))
        time.sleep(0.3)


def example_curl(url: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]
