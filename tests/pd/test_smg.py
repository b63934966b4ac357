"""An unmodified SMG gateway (PyPI `smg`) in front of our prefill and decode nodes over gRPC.

SMG tokenizes and applies the chat template itself, sends the same GenerateRequest (with
bootstrap host/port/room) to both legs, and detokenizes the decode's token stream. We check that
its OpenAI answers carry exactly what our colocated engine produces greedily for the same ids,
and that both nodes end idle.

Observed with smg 1.13.0:
* `/v1/completions` takes `prompt` only as a string or a list of strings (token-id arrays get
  400 "StringOrArray"), so exact token ids go through SMG's native `/generate` with `input_ids`.
* SMG tokenizes completion / `/generate` text WITHOUT the BOS that our tokenizer (and HF)
  adds by default, so the reference is computed on `encode(text, add_special_tokens=False)`.
* SMG's detokenizer never emits a trailing incomplete UTF-8 sequence: the text it returns is our
  lossy decode with the trailing U+FFFD characters removed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.kv_transfer import nixl_available
from fixtures.pdkit import free_port, start_pair, stub, wait_idle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason="smg (the SMG gateway) is not installed"),
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]

MAX_TOKENS = 8
IDS = [5, 17, 42, 7, 99, 3, 11, 250]
TEXT = "The quick brown fox"
CHAT = [{"role": "user", "content": "hi"}]
HTTP_TIMEOUT = 30.0


class Gateway:
    """`smg launch` in PD mode in its own process group; its log goes to a file."""

    def __init__(self, prefill: str, bootstrap: int, decode: str, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.base = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable,
            "-m",
            "smg",
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--pd-disaggregation",
            "--prefill",
            prefill,
            str(bootstrap),
            "--decode",
            decode,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "debug",
        ]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                start_new_session=True,
            )

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout: float = 30.0) -> None:
        """SMG's /readiness is 200 once each leg has a healthy worker and the tokenizer loaded."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.base + "/readiness", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = e
            time.sleep(0.1)
        raise AssertionError(f"smg not ready (exit {self.proc.poll()}, last {last!r}):\n{self.tail()}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=HTTP_TIMEOUT) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> Any:
        with self._open(path, body) as r:
            assert r.status == 200
            return json.loads(r.read())

    def post_sse(self, path: str, body: dict) -> list[dict]:
        """The `data:` events of a streamed response, up to (not including) `[DONE]`."""
        events = []
        with self._open(path, {**body, "stream": True}) as r:
            assert r.status == 200
            assert r.headers.get_content_type() == "text/event-stream"
            for raw in r:  # each read is bounded by the socket timeout
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return events
                events.append(json.loads(data))
        raise AssertionError(f"stream ended without [DONE]: {events}")

    def _open(self, path: str, body: dict):
        req = urllib.request.Request(self.base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=HTTP_TIMEOUT)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} -> {e.code}: {e.read()[:2000]!r}\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy colocated outputs (in process) for every prompt the test sends through SMG."""
    from engine.core import SamplingParams
    from engine.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(str(tiny_llama_dir), page_size=4))
    tok = eng.tokenizer
    prompts = {
        "ids": IDS,
        "text": tok.encode(TEXT, add_special_tokens=False),  # SMG adds no BOS (see module doc)
        "chat": tok.encode_chat(CHAT),
    }
    sp = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0)
    out = {}
    for name, ids in prompts.items():  # one at a time, as the PD decode runs them
        (o,) = eng.generate([ids], sp)
        assert len(o.output_ids) == MAX_TOKENS, (name, o.finish_reason)  # no early EOS: counts are checkable
        out[name] = (ids, list(o.output_ids), tok.decode(o.output_ids))
    return out


def smg_text(reference_text: str) -> str:
    """What SMG returns for a lossy decode: no trailing incomplete UTF-8 sequence."""
    return reference_text.rstrip("\ufffd")


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    prefill, decode = start_pair(str(tiny_llama_dir))
    gw = None
    try:
        gw = Gateway(
            f"grpc://127.0.0.1:{prefill.ports['scheduler']}",
            prefill.ports["bootstrap"],
            f"grpc://127.0.0.1:{decode.ports['scheduler']}",
            tmp_path_factory.mktemp("smg") / "smg.log",
        )
        gw.wait_ready(30)
        yield gw, stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"]), prefill, decode
    finally:
        if gw is not None:
            gw.kill()
        prefill.kill()
        decode.kill()


def _model(gw: Gateway) -> str:
    (model,) = [m["id"] for m in gw.get("/v1/models")["data"]]
    return model


def _idle(p, d) -> None:
    for s in (p, d):
        assert wait_idle(s, 20).num_used_tokens == 0


def test_registration(stack, tiny_llama_dir):
    gw, p, d, prefill, _ = stack
    assert _model(gw) == Path(tiny_llama_dir).name  # GetModelInfo.served_model_name
    workers = {w["worker_type"]: w for w in gw.get("/workers")["workers"]}
    assert set(workers) == {"prefill", "decode"}
    assert workers["prefill"]["bootstrap_port"] == prefill.ports["bootstrap"]
    for role, w in workers.items():
        assert (w["connection_mode"], w["runtime_type"], w["status"]) == ("grpc", "sglang", "ready"), w
        assert w["labels"]["disaggregation_mode"] == role
    # GetServerInfo.pairing_protocol: equal on both legs, so SMG pairs them
    assert workers["prefill"]["pd_pairing"] == workers["decode"]["pd_pairing"] != "?"


def test_generate_token_ids(stack, reference):
    """Exact ids in, exact ids out: SMG's native /generate (completions take no id arrays)."""
    gw, p, d, _, _ = stack
    ids, want_ids, _ = reference["ids"]
    body = {"model": _model(gw), "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    (res,) = gw.post("/generate", body)
    assert res["output_ids"] == want_ids
    assert res["meta_info"]["finish_reason"]["type"] == "length"
    assert (res["meta_info"]["prompt_tokens"], res["meta_info"]["completion_tokens"]) == (len(ids), MAX_TOKENS)
    events = gw.post_sse("/generate", body)
    # one event per new id; then a final event (finish_reason set) that smg 1.13 gives the last id again
    assert [t for e in events if e["meta_info"]["finish_reason"] is None for t in e["output_ids"]] == want_ids
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    _idle(p, d)


def test_completions(stack, reference):
    gw, p, d, _, _ = stack
    ids, _, want = reference["text"]
    # SMG's own tokenization of the prompt: our ids without BOS (it ignores add_special_tokens)
    assert gw.post("/v1/tokenize", {"model": _model(gw), "prompt": TEXT})["tokens"] == ids
    body = {"model": _model(gw), "prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0}
    res = gw.post("/v1/completions", body)
    (choice,) = res["choices"]
    assert choice["text"] == smg_text(want)
    assert choice["finish_reason"] == "length"
    # prompt_tokens == len(ids): SMG sent exactly the BOS-less ids the reference used
    assert (res["usage"]["prompt_tokens"], res["usage"]["completion_tokens"]) == (len(ids), MAX_TOKENS)

    events = gw.post_sse("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == smg_text(want)
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    _idle(p, d)


def test_chat_completions(stack, reference):
    gw, p, d, _, _ = stack
    ids, _, want = reference["chat"]
    body = {"model": _model(gw), "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    res = gw.post("/v1/chat/completions", body)
    (choice,) = res["choices"]
    assert choice["message"]["content"] == smg_text(want)
    assert choice["finish_reason"] == "length"
    # SMG rendered the chat template (tokenizer_config.json) itself: as many ids as ours, and the
    # output above and below matches the reference computed on ours
    assert (res["usage"]["prompt_tokens"], res["usage"]["completion_tokens"]) == (len(ids), MAX_TOKENS)

    events = gw.post_sse("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == smg_text(want)
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    _idle(p, d)


def test_node_logs_clean(stack):
    """No RPC that SMG makes (HealthCheck, GetModelInfo, GetServerInfo, GetLoads,
    SubscribeKvEvents, Generate, Abort) raised in our servicer."""
    _, _, _, prefill, decode = stack
    for node in (prefill, decode):
        bad = [line for line in node.lines if "Traceback" in line or " ERROR " in line]
        assert not bad, "\n".join(node.lines[-40:])
