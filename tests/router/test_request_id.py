"""X-Request-Id through the router's HTTP app (scripted dispatcher): taken from the client when valid,
made up otherwise, echoed on every response (errors and streams too), the base of the node-side ids,
and kept unique on the nodes' side while a reused id is still in flight."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from common.tokenizer import Tokenizer
from router.app import RouterApp
from router.contract import DispatchError
from tests.router.fake_dispatcher import FakeDispatcher, Script, server, wait_for

MODEL = "tiny-chat"
COMPLETION = {"model": MODEL, "prompt": "def f():", "max_tokens": 4}
GENERATED = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def make(tok: Tokenizer, script: Any = None, **app_kw: Any) -> tuple[TestClient, FakeDispatcher]:
    fake = FakeDispatcher(tok, script or (lambda job: Script()))
    app = RouterApp(fake, tok, served_model=MODEL, **app_kw).app
    return TestClient(app, raise_server_exceptions=False), fake


def test_a_client_id_names_the_jobs_and_is_echoed(tok: Tokenizer) -> None:
    client, fake = make(tok)
    r = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42" and [j.request_id for j in fake.jobs] == ["trace-42"]
    # n choices: one job each, all named after the request
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "n": 2, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-Request-Id": "chat-7"},
    )
    assert r.headers["x-request-id"] == "chat-7" and r.json()["id"] == "chatcmpl-chat-7"
    assert [j.request_id for j in fake.jobs[1:]] == ["chat-7-0", "chat-7-1"]
    # a body request_id still names the response, as before
    r = client.post("/v1/completions", json={**COMPLETION, "request_id": "mine"}, headers={"X-Request-Id": "hdr"})
    assert r.json()["id"] == "cmpl-mine" and r.headers["x-request-id"] == "hdr" and fake.jobs[-1].request_id == "hdr"


def test_streams_and_errors_echo_it_too(tok: Tokenizer) -> None:
    boom = DispatchError(503, "no pair", code="no_pair")
    client, fake = make(tok, lambda job: Script(error_before=boom) if "fail" in job.request_id else Script())
    with client.stream(
        "POST", "/v1/completions", json={**COMPLETION, "stream": True}, headers={"X-Request-Id": "s-1"}
    ) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
        assert "data: [DONE]" in r.read().decode()
    for path, body, rid, status in [
        ("/v1/completions", {**COMPLETION, "model": "nope"}, "e-404", 404),
        ("/v1/completions", {"prompt": 3}, "e-400", 400),
        ("/v1/completions", COMPLETION, "fail-503", 503),
        ("/nowhere", {}, "e-path", 404),
    ]:
        r = client.post(path, json=body, headers={"X-Request-Id": rid})
        assert (r.status_code, r.headers["x-request-id"]) == (status, rid), r.text
    r = client.get("/health", headers={"X-Request-Id": "probe"})
    assert r.headers["x-request-id"] == "probe"


def test_auth_failures_and_unexpected_errors_echo_it(tok: Tokenizer) -> None:
    client, _ = make(tok, api_keys={"k"})
    r = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "no-key"})
    assert (r.status_code, r.headers["x-request-id"]) == (401, "no-key")

    def crash() -> None:
        raise RuntimeError("a bug")

    client, fake = make(tok)
    fake.model = crash  # type: ignore[method-assign]
    r = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "bug-1"})
    assert (r.status_code, r.headers["x-request-id"]) == (500, "bug-1")


@pytest.mark.parametrize("sent", [None, "", "has space", "x" * 129, "tab\there", "ünïcode"])
def test_absent_or_invalid_ids_are_replaced_by_a_new_one(tok: Tokenizer, sent: str | None) -> None:
    client, fake = make(tok)
    headers = {} if sent is None else {"X-Request-Id": sent.encode("utf-8")}
    r = client.post("/v1/completions", json=COMPLETION, headers=headers)
    rid = r.headers["x-request-id"]
    assert GENERATED.fullmatch(rid) and fake.jobs[-1].request_id == rid and r.json()["id"] == f"cmpl-{rid}"


def test_the_longest_valid_id_is_kept(tok: Tokenizer) -> None:
    client, fake = make(tok)
    rid = "A" * 128
    assert client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": rid}).headers["x-request-id"] == rid
    assert fake.jobs[-1].request_id == rid


def test_an_id_reused_while_in_flight_gets_unique_node_ids(tok: Tokenizer) -> None:
    """A proxy retrying a timed-out request resends its id; the nodes must still see distinct ids."""
    _, fake = make(tok)
    fake.script = lambda job: Script(hang=len(fake.jobs) == 1)  # the first request never finishes
    app = RouterApp(fake, tok, served_model=MODEL).app
    with server(app) as url:

        def first() -> None:
            try:
                httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"X-Request-Id": "dup"}, timeout=3)
            except httpx.TimeoutException:
                pass  # it hangs by design; the client giving up ends it

        hanging = threading.Thread(target=first)
        hanging.start()
        assert wait_for(lambda: len(fake.jobs) == 1)
        r = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"X-Request-Id": "dup"}, timeout=10)
        assert r.status_code == 200 and r.headers["x-request-id"] == "dup"
        first_id, second_id = fake.jobs[0].request_id, fake.jobs[1].request_id
        assert first_id == "dup" and second_id.startswith("dup-") and second_id != first_id
        # an id that would extend one in flight (its choices are dup-0, dup-1 ...) is made unique too
        r = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"X-Request-Id": "dup-0"}, timeout=10)
        assert r.headers["x-request-id"] == "dup-0" and fake.jobs[2].request_id not in ("dup", "dup-0")
        hanging.join(10)
        assert wait_for(lambda: "dup" in fake.cancelled)
        r = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"X-Request-Id": "dup"}, timeout=10)
        assert fake.jobs[3].request_id == "dup"  # no longer in flight: used as is
