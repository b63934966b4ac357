"""Pieces of the live Prometheus test: a Prometheus server on loopback, a flaky fake decode node
(for retries, breakers and transfer failures), and the traffic the stack gets. Bounded waits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import grpc
import httpx
import yaml

from tests.deploy.promkit import RULE_FILES
from fixtures.pdkit import request, stub
from tests.router.fake_nodes import Behaviour, FakeNode

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\ndef walk(",
    "class Stack:\n    def push(self, item):",
    "for i in range(10):",
    "def parse_args(argv):",
    "with open(path) as f:",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


class Prometheus:
    """Debian's prometheus scraping `targets` every second; the repo's rules run every second too
    (their groups say 30s, which would make a short test wait for the first evaluation)."""

    def __init__(self, binary: str, workdir: Path, targets: dict[str, list[str]]) -> None:
        rules = []
        for f in RULE_FILES:
            doc = yaml.safe_load(f.read_text())
            for g in doc["groups"]:
                g["interval"] = "1s"
            (workdir / f.name).write_text(yaml.safe_dump(doc))
            rules.append(str(workdir / f.name))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": rules,
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addrs}]} for job, addrs in targets.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready")

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def targets_up(self) -> dict[str, float]:
        return {r["metric"]["instance"]: float(r["value"][1]) for r in self.query("up")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


class _NoModelInfo(FakeNode):
    """Answers no GetModelInfo, so the router takes its model card (tokenizer) from a real node."""

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "fake node: no model info")


class FlakyDecode:
    """A decode node whose every Generate fails before the first token: the router retries on the
    real pair, its breaker opens, and the prefill leg it started is aborted (a transfer failure)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        node = _NoModelInfo("decode", Behaviour(fail_before_first=True, pairing_protocol=None))
        self.node = asyncio.run_coroutine_threadsafe(node.start(), self.loop).result(30)

    @property
    def address(self) -> str:
        return self.node.address

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.node.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def wait_http_ok(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready within {timeout:.0f} s")
        time.sleep(0.3)


def _completion(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int) -> None:
    r = client.post(
        f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def _chat_stream(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]", lines[-3:]


def _aborted(client: httpx.Client, base: str, model: str) -> None:
    """A streamed request the client drops after its first chunk: the router aborts both legs."""
    body = {
        "model": model,
        "prompt": PROMPTS[0],
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream


def _bad_request(client: httpx.Client, base: str, model: str) -> None:
    r = client.post(f"{base}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -3})
    assert r.status_code == 400, r.text


def orphan_decode(decode_port: int, bootstrap_port: int) -> None:
    """A decode leg whose prefill leg never comes: the decode gives up after its --waiting-timeout,
    a real KV transfer failure (reason waiting_timeout) for the failure panels and rules."""
    try:
        list(stub(decode_port).Generate(request("orphan-1", [5, 6, 7, 8], 4242, bootstrap_port), timeout=60))
    except grpc.RpcError as e:
        assert "no KV from the prefill" in (e.details() or ""), e
        return
    raise AssertionError("an orphan decode leg completed")


def drive(pd_urls: Sequence[str], colocated_url: str, model: str, waves: int = 4, pause_s: float = 3.0) -> None:
    """Traffic in waves (so the pictures have a shape): completions and streamed chats through the
    PD routers in turn and the colocated one, plus one aborted stream and one bad request through
    the first PD router."""
    timeout = httpx.Timeout(120.0, connect=10.0)
    with httpx.Client(timeout=timeout) as client, ThreadPoolExecutor(4) as pool:
        jobs = []
        for wave in range(waves):
            for i, prompt in enumerate(PROMPTS):
                pd_url = pd_urls[(wave + i) % len(pd_urls)]
                jobs.append(pool.submit(_completion, client, pd_url, model, prompt, 24 + 8 * wave))
                if i % 2 == 0:
                    jobs.append(pool.submit(_chat_stream, client, pd_url, model, prompt, 24))
                    jobs.append(pool.submit(_completion, client, colocated_url, model, prompt, 24))
            if wave == 0:
                jobs.append(pool.submit(_aborted, client, pd_urls[0], model))
                jobs.append(pool.submit(_bad_request, client, pd_urls[0], model))
            for j in jobs:
                j.result(timeout=180)
            time.sleep(pause_s)
