"""`pdserve up` end to end: a real local deployment (prefill + decode + router processes) comes up,
prints every node's metrics URL, its URL and a curl line that works, serves a completion, and on
Ctrl-C (SIGINT to its process group) takes every child down with it, the router first. Bounded
waits; leftovers are killed by pid."""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from engine.kv_transfer import nixl_available
from fixtures.procs import start_up

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")
UP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` (Linux /proc): pid -> command line."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # it went away meanwhile
    return out


def _running(pid: int, cmdline: str) -> bool:
    """Still there (not a zombie) and still the same program (pids are not reused that fast, but check)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return state != "Z" and now == cmdline


def _pgrep(pattern: str) -> list[int]:
    r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, timeout=10, check=False)
    return [int(p) for p in r.stdout.split()]


@pytest.mark.slow
def test_up_serves_and_ctrl_c_stops_every_child(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = str(tiny_llama_dir)  # a unique tmp path: it names exactly this deployment's nodes
    stderr = open(tmp_path / "up.stderr", "w")  # noqa: SIM115 - closed in the finally below
    proc = start_up(["--port", "0", "--model", model, "--verbose"], stderr)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    children: dict[int, str] = {}

    def next_line(deadline: float) -> str:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            stderr.flush()
            tail = (tmp_path / "up.stderr").read_text()[-3000:]
            raise AssertionError(f"pdserve up printed nothing more (exit code {proc.poll()}):\n{tail}")
        return line

    try:
        start = time.monotonic()
        deadline = start + UP_TIMEOUT_S
        while not (line := next_line(deadline)).startswith("pdserve is up: "):
            pass
        up_s = time.monotonic() - start
        url = line.split()[3]
        assert url.startswith("http://127.0.0.1:") and line.endswith(f"(OpenAI API under {url}/v1)")

        # The curl line: curl -s URL/v1/completions -H 'Content-Type: application/json' -d '{json}'
        curl = shlex.split(next_line(time.monotonic() + 10))
        assert curl[:3] == ["curl", "-s", f"{url}/v1/completions"], curl
        assert curl[3:5] == ["-H", "Content-Type: application/json"] and curl[5] == "-d" and len(curl) == 7, curl
        body = json.loads(curl[6])
        after = [next_line(time.monotonic() + 10) for _ in range(2)]  # then each node's /metrics
        metrics = dict(ln.split(" metrics: ") for ln in after if " metrics: " in ln)
        assert sorted(metrics) == ["decode-0", "prefill-0"], after
        for name, metrics_url in metrics.items():  # the KV and queue gauges the dashboards read
            assert metrics_url.startswith("http://127.0.0.1:") and metrics_url.endswith("/metrics")
            with urllib.request.urlopen(metrics_url, timeout=10) as r:
                text = r.read().decode()
            role = name.split("-")[0]
            assert f'pdserve_kv_cache_used_tokens{{role="{role}"}}' in text, text[:2000]
            assert f'pdserve_node_waiting_requests{{role="{role}"}}' in text
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            assert body["model"] == json.load(r)["data"][0]["id"]
        assert isinstance(body["prompt"], str) and body["prompt"] and body["max_tokens"] >= 1

        # What the curl line does, with urllib.
        req = urllib.request.Request(
            f"{url}/v1/completions", data=curl[6].encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            resp = json.load(r)
        choice = resp["choices"][0]
        assert resp["object"] == "text_completion" and isinstance(choice["text"], str) and choice["text"]
        assert 1 <= resp["usage"]["completion_tokens"] <= body["max_tokens"]

        children = _children(proc.pid)
        roles = sorted(c.split("pdserve.cli", 1)[1].split()[0] for c in children.values() if "pdserve.cli" in c)
        assert roles == ["decode", "prefill", "router"], children
        assert set(_pgrep(model)) >= {pid for pid, c in children.items() if model in c}

        # Ctrl-C: SIGINT to the foreground process group (its own session, as a terminal would).
        stopped = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(STOP_TIMEOUT_S) == 0
        while left := [pid for pid, c in children.items() if _running(pid, c)]:
            assert time.monotonic() - stopped < STOP_TIMEOUT_S, f"children left after Ctrl-C: {left}"
            time.sleep(0.1)
        assert _pgrep(model) == []
        stderr.flush()
        logs = (tmp_path / "up.stderr").read_text()  # every child's log (--verbose)
        assert "[router]" in logs and "[prefill-0]" in logs and "[decode-0]" in logs
        # the router stopped before its nodes: it never saw one go away
        assert not [ln for ln in logs.splitlines() if " is down" in ln], logs[-3000:]
        print(f"up: ready in {up_s:.1f} s; stopped with every child in {time.monotonic() - stopped:.1f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid, cmdline in children.items():  # each child leads its own session: kill by its id
            if _running(pid, cmdline):
                os.killpg(pid, signal.SIGKILL)
        stderr.close()


def test_nodes_sharing_a_gpu_load_in_turn_with_cumulative_memory_shares() -> None:
    """Two nodes on cuda:0 and one on cuda:1: cuda:0's second node starts after its first, with
    twice its share of the default fraction; CPU nodes all start at once; an operator's own KV
    sizing is left alone."""
    from common.defaults import DEFAULT_MEM_FRACTION_STATIC as F
    from pdserve.up import _sizes_kv_itself, _waves

    plans = [
        ("prefill-0", ["prefill"], "cuda:0"),
        ("decode-0", ["decode"], "cuda:0"),
        ("decode-1", ["decode"], "cuda:1"),
    ]
    waves = _waves(plans, sizes_kv_itself=False)
    assert [[name for name, _, _ in w] for w in waves] == [["prefill-0", "decode-1"], ["decode-0"]]
    shares = {name: args[-1] for w in waves for name, args, _ in w if "--mem-fraction-static" in args}
    assert shares == {"prefill-0": f"{F / 2:.4f}", "decode-0": f"{F:.4f}"}
    assert _waves(plans, sizes_kv_itself=True)[1] == [("decode-0", ["decode"], "cuda:0")]
    cpu = [(n, a, "cpu") for n, a, _ in plans]
    assert _waves(cpu, sizes_kv_itself=False) == [cpu]
    assert _sizes_kv_itself(("--max-total-tokens", "4096")) and _sizes_kv_itself(("--mem-fraction-static=0.5",))
    assert not _sizes_kv_itself(("--page-size", "16"))


STUB = """
import signal, sys, time
name, log = sys.argv[1], sys.argv[2]
def bye(*_):
    with open(log, "a") as f:
        f.write(f"{name} got SIGTERM\\n")
    time.sleep(0.2)  # a clean stop takes a moment: nobody may be stopped meanwhile
    with open(log, "a") as f:
        f.write(f"{name} exited\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("READY", flush=True)
while True:
    time.sleep(1)
"""


def test_stop_takes_the_router_down_before_any_node(tmp_path: Path) -> None:
    """Stand-in children that log their SIGTERM and exit: the router has exited before any node
    is told to stop, and every node is stopped."""
    from pdserve.up import Child, Deployment, UpConfig

    log = tmp_path / "stops.log"
    dep = Deployment(UpConfig(None))
    try:
        for name in ("prefill-0", "decode-0", "router"):  # the order `start` spawns them in
            proc = subprocess.Popen(
                [sys.executable, "-c", STUB, name, str(log)],
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            assert proc.stdout is not None and proc.stdout.readline().startswith("READY")
            dep.children.append(Child(name, proc))
        dep.stop(grace_s=10.0)
        lines = log.read_text().splitlines()
        assert lines[:2] == ["router got SIGTERM", "router exited"], lines
        assert sorted(lines[2:]) == sorted(
            f"{n} {e}" for n in ("prefill-0", "decode-0") for e in ("got SIGTERM", "exited")
        )
        assert all(c.proc.returncode == 0 for c in dep.children)
    finally:
        for c in dep.children:
            if c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(5)
