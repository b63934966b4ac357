"""The router's HTTP side against a scripted dispatcher: OpenAI shapes (checked with the official
client over a real uvicorn server), streaming, stop strings, errors, auth, shedding, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from common.tokenizer import Tokenizer
from router.app import RouterApp
from router.contract import DispatchError, GenerationJob
from tests.router.fake_dispatcher import FakeDispatcher, Script, server, sse_lines, wait_for

MODEL = "tiny-chat"
REPLY = "Hello wörld, 世界 🎉 done"


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def make(
    tok: Tokenizer, script: Callable[[GenerationJob], Script] | None = None, **kw: Any
) -> tuple[FastAPI, FakeDispatcher]:
    app_kw = {k: kw.pop(k) for k in ("api_keys", "max_body_bytes", "max_queue") if k in kw}
    fake = FakeDispatcher(tok, script or (lambda job: Script(reply=REPLY)), **kw)
    return RouterApp(fake, tok, served_model=MODEL, **app_kw).app, fake


def stream_text(payloads: list[str], chat: bool) -> dict[int, str]:
    out: dict[int, str] = {}
    for p in payloads[:-1]:
        for c in json.loads(p)["choices"]:
            piece = c["delta"].get("content") if chat else c["text"]
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return out


# --- the official client over a real server --------------------------------------------------------------


def test_completions_with_openai_client(tok: Tokenizer) -> None:
    app, fake = make(tok)
    with server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        full = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=64)
        assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == MODEL
        assert [c.text for c in full.choices] == [REPLY] and full.choices[0].finish_reason == "stop"
        n_prompt = len(tok.encode("def fibonacci(n):"))
        n_reply = len(tok.encode(REPLY, add_special_tokens=False)) + 1  # + EOS, counted but never shown
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (n_prompt, n_reply)
        assert full.usage.total_tokens == n_prompt + n_reply

        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt="def fibonacci(n):",
                max_tokens=64,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

        short = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
        assert short.choices[0].text == tok.decode(tok.encode(REPLY, add_special_tokens=False)[:3])
    assert fake.jobs[0].input_ids == tuple(tok.encode("def fibonacci(n):")) and not fake.cancelled


def test_chat_with_async_openai_client(tok: Tokenizer) -> None:
    app, fake = make(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]

    async def run(url: str) -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        full = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=64)
        assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
        msg = full.choices[0].message
        assert (msg.role, msg.content, full.choices[0].finish_reason) == ("assistant", REPLY, "stop")
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
        assert chunks[-1].usage == full.usage and chunks[-2].choices[0].finish_reason == "stop"
        await client.close()

    with server(app) as url:
        asyncio.run(run(url))
    # The template renders its own BOS; the router must not add a second one.
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert fake.jobs[0].input_ids == tuple(ids) and ids.count(tok.bos_token_id) == 1
    assert fake.jobs[0].sampling.max_new_tokens == 64
    assert fake.jobs[1].sampling.max_new_tokens == 128 - len(ids)  # chat default: the rest of the context


def test_n_and_batched_prompts(tok: Tokenizer) -> None:
    replies = {0: "first answer", 1: "second one", 2: "third", 3: "fourth reply"}
    app, fake = make(tok, lambda job: Script(reply=replies[int(job.request_id.rsplit("-", 1)[1])]))
    with server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        out = client.completions.create(model=MODEL, prompt=["one", "two two"], n=2, max_tokens=20, seed=7)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert [c.text for c in out.choices] == [replies[i] for i in range(4)]
        # Prompt tokens count once per prompt; each choice's tokens count.
        assert out.usage.prompt_tokens == len(tok.encode("one")) + len(tok.encode("two two"))
        assert out.usage.completion_tokens == sum(
            len(tok.encode(r, add_special_tokens=False)) + 1 for r in replies.values()
        )
        assert len({j.request_id for j in fake.jobs}) == 4
        assert [j.sampling.seed for j in fake.jobs] == [7, 8, 7, 8]  # distinct choices per prompt
        fake.jobs.clear()
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, stream=True
        )
        texts: dict[int, str] = {}
        for c in chat:
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        assert texts == {0: replies[0], 1: replies[1]}


def test_token_id_prompts_and_abort_reason(tok: Tokenizer) -> None:
    app, fake = make(tok, lambda job: Script(reply="cut", finish_reason="abort"))
    with server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8)
        # "abort" is outside the client's Literal but it parses it (models are built unvalidated).
        assert out.choices[0].finish_reason == "abort" and out.choices[0].text == "cut"
        out = client.completions.create(model=MODEL, prompt=[[5, 6], [7]], max_tokens=8)
        assert len(out.choices) == 2
    assert [j.input_ids for j in fake.jobs] == [(5, 6, 7), (5, 6), (7,)]


def test_logprobs_shapes(tok: Tokenizer) -> None:
    app, _ = make(tok, lambda job: Script(reply="ab"))
    with server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=8, logprobs=2)
        lp = out.choices[0].logprobs
        assert lp.token_logprobs == [-0.5] * 3 and len(lp.top_logprobs[0]) == 2 and len(lp.tokens) == 3
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3
        )
        content = chat.choices[0].logprobs.content
        assert [c.logprob for c in content] == [-0.5] * 3 and all(len(c.top_logprobs) == 3 for c in content)


# --- text: stop strings across tokens and multi-byte characters ------------------------------------------


@pytest.mark.parametrize("stop", ["世界", "ö", "rld, 世", ["🎉", "wö"]])
def test_stop_strings_cut_exactly_and_cancel(tok: Tokenizer, stop: str | list[str]) -> None:
    app, fake = make(tok, lambda job: Script(reply=REPLY, hang=True))
    stops = [stop] if isinstance(stop, str) else stop
    want = REPLY[: min(REPLY.index(s) for s in stops)]
    client = TestClient(app)
    for stream in (False, True):
        r = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 60, "stop": stop, "stream": stream}
        )
        assert r.status_code == 200, r.text
        if stream:
            payloads = sse_lines(r.text)
            assert payloads[-1] == "[DONE]" and stream_text(payloads, chat=False) == {0: want}
            assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "stop"
        else:
            assert r.json()["choices"][0]["text"] == want and r.json()["choices"][0]["finish_reason"] == "stop"
    # The node would have hung forever: the router's stop string cancelled both requests.
    assert sorted(fake.cancelled) == sorted(j.request_id for j in fake.jobs) and len(fake.jobs) == 2


def test_node_side_stop_is_trimmed_consistently(tok: Tokenizer) -> None:
    ids = tok.encode("abc END xyz", add_special_tokens=False)
    upto_end = next(k for k in range(len(ids) + 1) if tok.decode(ids[:k]).endswith("END"))
    upto_en = next(k for k in range(len(ids) + 1) if tok.decode(ids[:k]).endswith("EN"))
    cases = {"full": (ids[:upto_end], "abc "), "partial": (ids[:upto_en], "abc ")}
    for name, (node_ids, want) in cases.items():
        app, fake = make(tok, lambda job, t=node_ids: Script(tokens=t, finish_reason="stop", matched_stop="END"))
        r = TestClient(app).post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "stop": "END", "max_tokens": 20}
        )
        assert r.json()["choices"][0]["text"] == want, name
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["usage"]["completion_tokens"] == len(node_ids)


def test_multibyte_tokens_never_split(tok: Tokenizer) -> None:
    app, _ = make(tok, lambda job: Script(reply="世界🎉ö", chunk=1))
    r = TestClient(app).post(
        "/v1/chat/completions", json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    )
    pieces = [c["delta"].get("content") for p in sse_lines(r.text)[:-1] for c in json.loads(p)["choices"]]
    assert "".join(p or "" for p in pieces) == "世界🎉ö" and not any("\ufffd" in (p or "") for p in pieces)


# --- errors ----------------------------------------------------------------------------------------------

BAD = [
    ({"model": MODEL, "prompt": "x", "foo": 1}, 400, "foo", "unknown_parameter"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.1}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": 17}, 400, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": True}, 400, "n", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, 400, "logprobs", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo", "unsupported_parameter"),
    (
        {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "unsupported_parameter",
    ),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "empty_prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt", "empty_prompt"),
    ({"model": MODEL, "prompt": [[]]}, 400, "prompt", "empty_prompt"),
    ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", "invalid_token_id"),
    ({"model": MODEL, "prompt": "x " * 120}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 200}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "x"}, 400, "model", "missing_required_parameter"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
]
BAD_CHAT = [
    ({"model": MODEL, "messages": []}, 400, "messages", "empty_messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages[0].role", "missing_required_parameter"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "unsupported_parameter",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
        "missing_required_parameter",
    ),
    (  # the tiny model's template shows no tool-call format and no --tool-call-parser is given
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        400,
        "tools",
        "unsupported_parameter",
    ),
]


def check_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == (
        "invalid_request_error" if status < 429 else "server_error" if status >= 500 else "rate_limit_error"
    )
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


@pytest.mark.parametrize(
    "path,body,status,param,code",
    [("/v1/completions", *b) for b in BAD] + [("/v1/chat/completions", *b) for b in BAD_CHAT],
)
def test_bad_requests(tok: Tokenizer, path: str, body: dict[str, Any], status: int, param: str, code: str) -> None:
    app, fake = make(tok)
    check_error(TestClient(app).post(path, json=body), status, param, code)
    assert not fake.jobs


def test_bad_bodies(tok: Tokenizer) -> None:
    app, fake = make(tok, max_body_bytes=1000)
    client = TestClient(app)
    check_error(client.post("/v1/completions", content=b"{not json"), 400, code="invalid_json")
    check_error(client.post("/v1/completions", content=b"[1, 2]"), 400, code="invalid_json")
    check_error(client.post("/v1/completions", content=b"\xff\xfe"), 400, code="invalid_json")
    check_error(
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000}), 413, code="request_too_large"
    )

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit must hold while reading
        yield b'{"model": "tiny-chat", "prompt": "'
        yield b"x" * 2000
        yield b'"}'

    check_error(client.post("/v1/completions", content=chunked()), 413, code="request_too_large")
    check_error(client.get("/v1/nope"), 404, code="not_found")
    check_error(client.get("/v1/completions"), 405)
    assert not fake.jobs


def test_api_keys(tok: Tokenizer) -> None:
    app, _ = make(tok, api_keys={"sk-good", "sk-other"})
    client = TestClient(app)
    body = {"model": MODEL, "prompt": "x"}
    check_error(client.post("/v1/completions", json=body), 401, code="invalid_api_key")
    check_error(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-bad"}), 401)
    check_error(client.post("/v1/completions", json=body, headers={"Authorization": "sk-good"}), 401)
    check_error(client.get("/v1/models"), 401)
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-good"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-other"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200  # probes open
    with server(app) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-bad", max_retries=0).models.list()


def test_dispatch_errors_before_first_token(tok: Tokenizer) -> None:
    err = DispatchError(503, "no healthy prefill/decode pair", code="no_pair", retry_after_s=2.5)
    app, fake = make(tok, lambda job: Script(error_before=err))
    client = TestClient(app)
    for stream in (False, True):  # a stream that fails before its first event still gets a real status
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
        check_error(r, 503, code="no_pair")
        assert r.headers["retry-after"] == "3" and r.json()["error"]["message"] == err.message
    fake.script = lambda job: Script(error_before=DispatchError(429, "shed by nodes", code="overloaded"))
    check_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 429, code="overloaded")
    fake.has_model = False
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    check_error(r, 503, code="model_not_ready")
    assert "retry-after" in r.headers


def test_error_after_first_byte_is_a_json_event(tok: Tokenizer) -> None:
    app, fake = make(tok, lambda job: Script(reply=REPLY, error_after=3))
    for path, body in [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        r = TestClient(app).post(path, json={"model": MODEL, "stream": True, **body})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_lines(r.text)
        assert payloads[-1] == "[DONE]"
        err = json.loads(payloads[-2])["error"]
        assert err["type"] == "server_error" and "mid-stream" in err["message"]
        assert all("choices" in json.loads(p) for p in payloads[:-2])  # every earlier event is a chunk
    # Non-streamed, the same failure is a plain 502.
    check_error(TestClient(app).post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 502)
    with server(app) as url:  # the official client turns the error event into an exception
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.APIError, match="mid-stream"):
            list(client.completions.create(model=MODEL, prompt="x", stream=True))


def test_client_disconnect_cancels_the_dispatcher(tok: Tokenizer) -> None:
    app, fake = make(tok, lambda job: Script(reply=REPLY, hang=True))
    with server(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "stream": True, "n": 2, "messages": [{"role": "user", "content": "x"}]},
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            time.sleep(0.2)
            assert not fake.cancelled and fake.started  # the stream is live
        assert wait_for(lambda: len(fake.cancelled) == 2), fake.cancelled
        # Non-streamed: the client gives up waiting and closes the connection.
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=0.5)
        assert wait_for(lambda: len(fake.cancelled) == 3), fake.cancelled
        assert wait_for(lambda: b"pdserve_router_requests_in_flight 0.0" in http.get("/metrics").content)


def test_shedding(tok: Tokenizer) -> None:
    app, fake = make(tok, lambda job: Script(hang=True), max_queue=1)
    with server(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        body = {"model": MODEL, "prompt": "x", "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            r = http.post("/v1/completions", json=body)
            check_error(r, 503, code="server_overloaded")
            assert r.headers["retry-after"] == "1"
        assert wait_for(lambda: len(fake.cancelled) == 1)
        fake.script = lambda job: Script()
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200


def test_models_health_ready_metrics(tok: Tokenizer) -> None:
    app, fake = make(tok, lambda job: Script(disaggregated=job.stream))
    other, _ = make(tok)  # a second app in the same process: registries must not collide
    client = TestClient(app)
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["max_model_len"] == 128
    check_error(client.get("/v1/models/other"), 404, code="model_not_found")
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200
    fake.is_ready = False
    r = client.get("/ready")
    assert r.status_code == 503 and r.json() == {"status": "not_ready"}
    assert client.get("/health").status_code == 200
    fake.is_ready = True
    assert client.get("/ready").status_code == 200

    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
    text = client.get("/metrics").text
    for needle in [
        'pdserve_router_time_to_first_token_seconds_bucket{endpoint="/v1/completions"',
        'pdserve_router_inter_token_latency_seconds_count{endpoint="/v1/chat/completions"}',
        'pdserve_router_e2e_request_latency_seconds_count{disaggregated="true",endpoint="/v1/completions"} 1.0',
        'pdserve_router_e2e_request_latency_seconds_count{disaggregated="false",endpoint="/v1/chat/comp',
        'pdserve_router_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        'pdserve_router_requests_total{endpoint="/v1/completions",status="400"} 1.0',
        "pdserve_router_requests_in_flight 0.0",
    ]:
        assert needle in text, needle
    assert "pdserve_router_requests_total{" not in TestClient(other).get("/metrics").text
