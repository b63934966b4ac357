"""The router end to end on loopback: a real router process in front of a real prefill node and two
real decode nodes (KV over NIXL), driven with the official openai client and raw httpx.

What test_app/test_dispatch cover with fakes is not repeated; here the point is the whole chain:
tokenization and usage against the real tokenizer, seeded sampling across the PD handoff, errors
that must never reach (or must leave nothing on) a node, a client disconnect aborting both legs,
and a decode node killed under load. Every wait is bounded; every process is killed at the end.
The tests share one stack; the fault test runs last (it kills and replaces decode nodes)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from common.tokenizer import Tokenizer
from fixtures.pdkit import stub, wait_idle
from fixtures.waiting import wait_until
from tests.router.stack import Stack, decode_node, start_stack, wait_status

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]

CONTEXT = 4096  # the tiny Llama with a longer context: a disconnect test needs a long generation
PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama_dir with max_position_embeddings raised (RoPE: same weights, longer context)."""
    out = tmp_path_factory.mktemp("tiny-llama-long")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = CONTEXT
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Any:
    s = start_stack(str(model_dir), decodes=2)
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)


def _check_usage(usage: Any, finish: str | None, n_prompt: int, max_tokens: int) -> None:
    assert usage.prompt_tokens == n_prompt
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish == "length":
        assert usage.completion_tokens == max_tokens
    else:
        assert finish == "stop" and 1 <= usage.completion_tokens <= max_tokens


def _counts(usage: Any) -> tuple[int, int, int]:
    """The token counts; cached_tokens differs between a request and its repeat (the prefix cache)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


# --- the official client ----------------------------------------------------------------------------------


def test_sync_client_stream_equals_non_stream(stack: Stack, tok: Tokenizer) -> None:
    c, model = _client(stack), stack.served_model
    ids = tok.encode(PROMPT)
    # The router encodes completions prompts with special tokens: this tokenizer adds BOS.
    assert tok.bos_token_id is not None and ids[0] == tok.bos_token_id
    chat_ids = tok.encode_chat(MESSAGES)  # the template renders its own BOS; nothing is added
    kw: dict[str, Any] = {"model": model, "temperature": 0.8, "seed": 1234}
    for max_tokens, extra in ((24, {}), (40, {"ignore_eos": True})):
        full = c.completions.create(prompt=PROMPT, max_tokens=max_tokens, extra_body=extra, **kw)
        assert full.object == "text_completion" and len(full.choices) == 1
        _check_usage(full.usage, full.choices[0].finish_reason, len(ids), max_tokens)
        chunks = list(
            c.completions.create(
                prompt=PROMPT,
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
                **kw,
            )
        )
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
        assert _counts(chunks[-1].usage) == _counts(full.usage)

        chat = c.chat.completions.create(messages=MESSAGES, max_completion_tokens=max_tokens, extra_body=extra, **kw)
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        _check_usage(chat.usage, chat.choices[0].finish_reason, len(chat_ids), max_tokens)
        chunks = list(
            c.chat.completions.create(
                messages=MESSAGES,
                max_completion_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
                **kw,
            )
        )
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == chat.choices[0].message.content
        assert _counts(chunks[-1].usage) == _counts(chat.usage)
    # ignore_eos forced "length": the completion_tokens == max_tokens branch really ran.
    assert full.choices[0].finish_reason == "length" and chat.choices[0].finish_reason == "length"


def test_async_client_concurrent_requests(stack: Stack, tok: Tokenizer) -> None:
    model, n_prompt, n_chat = stack.served_model, len(tok.encode(PROMPT)), len(tok.encode_chat(MESSAGES))

    async def main() -> None:
        c = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
        kw: dict[str, Any] = {"model": model, "temperature": 0.8, "max_tokens": 16}

        async def cmpl(seed: int) -> tuple[str, str]:
            full = await c.completions.create(prompt=PROMPT, seed=seed, **kw)
            _check_usage(full.usage, full.choices[0].finish_reason, n_prompt, 16)
            text = "".join(
                [
                    ch.choices[0].text
                    async for ch in await c.completions.create(prompt=PROMPT, seed=seed, stream=True, **kw)
                ]
            )
            return full.choices[0].text, text

        async def chat(seed: int) -> tuple[str, str]:
            full = await c.chat.completions.create(messages=MESSAGES, seed=seed, **kw)
            _check_usage(full.usage, full.choices[0].finish_reason, n_chat, 16)
            text = "".join(
                [
                    ch.choices[0].delta.content or ""
                    async for ch in await c.chat.completions.create(messages=MESSAGES, seed=seed, stream=True, **kw)
                    if ch.choices
                ]
            )
            return full.choices[0].message.content or "", text

        pairs = await asyncio.wait_for(asyncio.gather(*[f(s) for s in (1, 2, 3) for f in (cmpl, chat)]), 60)
        for full, streamed in pairs:
            assert full == streamed
        assert len({full for full, _ in pairs[0::2]}) > 1  # different seeds really sample differently
        await c.close()

    asyncio.run(main())


# --- errors through the real stack ----------------------------------------------------------------------


def test_bad_inputs_get_openai_errors_and_leave_nodes_idle(stack: Stack, tok: Tokenizer) -> None:
    model = stack.served_model
    too_long = "hello " * (CONTEXT + 10)
    assert len(tok.encode(too_long)) > CONTEXT
    cases: list[tuple[str, Any, int, str | None, str]] = [
        ("/v1/completions", b'{"model": "x", "prompt": ', 400, None, "invalid_json"),
        ("/v1/completions", {"model": model, "prompt": PROMPT, "temperature": -1}, 400, "temperature", "invalid_value"),
        (
            "/v1/chat/completions",
            {"model": model, "messages": MESSAGES, "temperature": -1, "stream": True},
            400,
            "temperature",
            "invalid_value",
        ),
        ("/v1/completions", {"model": "no-such-model", "prompt": PROMPT}, 404, "model", "model_not_found"),
        (
            "/v1/completions",
            {"model": model, "prompt": too_long, "stream": True},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": too_long}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": model, "prompt": [5, 10**6]}, 400, "prompt", "invalid_token_id"),
    ]
    with httpx.Client(base_url=stack.url, timeout=30) as h:
        for path, body, status, param, code in cases:
            r = h.post(path, content=body) if isinstance(body, bytes) else h.post(path, json=body)
            assert r.status_code == status, (path, body if isinstance(body, bytes) else list(body), r.text[:300])
            assert r.headers["content-type"].startswith("application/json")
            err = r.json()["error"]
            assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
            assert isinstance(err["message"], str) and err["message"]
    # The official client maps them onto its typed exceptions.
    c = _client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert e.value.code == "invalid_value" and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert nf.value.code == "model_not_found"
    stack.wait_all_idle(10)
    # And the stack still serves.
    ok = c.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens <= 4


# --- a client that goes away ---------------------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts_both_legs(stack: Stack, tok: Tokenizer) -> None:
    max_tokens = CONTEXT - 100
    n_prompt = len(tok.encode(PROMPT))
    body = {
        "model": stack.served_model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stubs = [stub(n.ports["scheduler"]) for n in stack.live_nodes()]
    data: list[str] = []
    with httpx.Client(base_url=stack.url, timeout=30) as h, h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held, not broken out of: leaving the loop would close the connection
        while len(data) < 2:
            if (line := next(lines)).startswith("data: "):
                data.append(line)
        # Still connected: the request is running on a decode (generating, with its KV held).
        before = [s.GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0] for s in stubs]
        assert sum(x.num_running_reqs for x in before) == 1, before
    closed = time.monotonic()
    assert all(json.loads(d[6:])["object"] == "text_completion" for d in data)
    # Watch every node wind down: the decode's KV (whole pages of prompt + generated tokens) would
    # climb towards prompt + max_tokens (about 12 s here) if it kept generating; an abort frees it early.
    high = max(x.num_used_tokens for x in before)
    assert high > 0
    while True:
        loads = [s.GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0] for s in stubs]
        high = max([high, *(x.num_used_tokens for x in loads)])
        if all(x.num_used_tokens == 0 and x.num_running_reqs == 0 and x.num_waiting_reqs == 0 for x in loads):
            break
        assert time.monotonic() - closed < 15, f"nodes still busy 15 s after the disconnect: {loads}"
        time.sleep(0.005)
    took = time.monotonic() - closed
    assert high < n_prompt + max_tokens // 2, f"the decode generated on after the disconnect (KV high-water {high})"
    stack.wait_all_idle(10)
    print(f"disconnect: idle {took:.2f} s after close; KV high-water {high} of {n_prompt + max_tokens}")


# --- a decode node dies under load (runs last: it replaces decode nodes) -------------------------------------


def _stream(url: str, model: str, i: int, out: dict[int, dict[str, Any]], max_tokens: int) -> None:
    """One streamed completion; records status, data lines and whether a byte arrived."""
    rec: dict[str, Any] = {"status": None, "data": [], "error": None, "first": None}
    out[i] = rec
    body = {
        "model": model,
        "prompt": f"request {i}: {PROMPT}",
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(45, connect=5)) as h,
            h.stream("POST", f"{url}/v1/completions", json=body) as r,
        ):
            rec["status"], rec["request_id"] = r.status_code, r.headers.get("x-request-id")
            if r.status_code != 200:
                rec["body"] = r.read().decode()
                return
            for line in r.iter_lines():
                if line.startswith("data: "):
                    rec["first"] = rec["first"] or time.monotonic()
                    rec["data"].append(line[6:])
    except Exception as e:  # noqa: BLE001 - a hang ends in httpx's read timeout; the test reports it
        rec["error"] = repr(e)


def _outcome(rec: dict[str, Any], max_tokens: int) -> str:
    """ "ok" (complete stream) or "error_event" (JSON error, then [DONE]); anything else fails the test."""
    assert rec["error"] is None and rec["status"] == 200, rec
    data = rec["data"]
    assert data and data[-1] == "[DONE]", rec
    events = [json.loads(d) for d in data[:-1]]
    if "error" in events[-1]:
        err = events[-1]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error", err
        # the stream had started (a token reached the router, so no retry was allowed), but that
        # token may not have produced visible text yet (a partial UTF-8 character): the error
        # event can be the first event the client sees
        assert all("error" not in e for e in events[:-1])
        return "error_event"
    assert all("error" not in e for e in events), rec
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return "ok"


def _retries(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("pdserve_router_retries_total"))


def test_metrics_split_ttft_by_stage_and_label_disaggregation(stack: Stack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{stack.url}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    counts = {
        s.labels["stage"]: s.value
        for s in families["pdserve_router_ttft_stage_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts["queue"] > 0 and counts["prefill"] == counts["queue"] and counts["first_decode"] > 0
    # the real prefill's answer carries the first token, and the router relays it before the
    # decode (which must still notice the write and adopt the request) streams it
    sources = {
        s.labels["source"]: s.value
        for s in families["pdserve_router_first_token_source"].samples
        if s.name.endswith("_total")
    }
    assert sources.get("prefill", 0) > 0 and sum(sources.values()) == counts["queue"]
    e2e = [
        s
        for s in families["pdserve_router_e2e_request_latency_seconds"].samples
        if s.name.endswith("_count") and s.value > 0
    ]
    assert e2e and all(s.labels["disaggregated"] == "true" for s in e2e)


def test_decode_killed_under_load_then_ready_follows_the_nodes(stack: Stack) -> None:
    max_tokens, out, early = 600, {}, 9
    model = stack.served_model
    threads = [
        threading.Thread(target=_stream, args=(stack.url, model, i, out, max_tokens), daemon=True) for i in range(12)
    ]
    retries_before = _retries(stack.url)
    for t in threads[:early]:
        t.start()
    deadline = time.monotonic() + 30
    while sum(1 for r in out.values() if r["first"]) < 2:  # some stream, the rest still starting
        assert time.monotonic() < deadline, out
        time.sleep(0.005)
    victim = stack.decodes[0]
    victim_port = victim.ports["scheduler"]
    victim.kill()
    killed_at = time.monotonic()
    for t in threads[early:]:  # no byte before the kill: these must be retried, never fail
        t.start()
    for t in threads:
        t.join(max(0.1, killed_at + 60 - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a request hung after the decode kill"
    outcomes = {i: _outcome(out[i], max_tokens) for i in range(12)}
    assert all(outcomes[i] == "ok" for i in range(early, 12)), outcomes
    for i, o in outcomes.items():  # only a stream that had its first byte may end in an error event
        assert o == "ok" or out[i]["first"] < killed_at + 2.0, (i, out[i]["first"] - killed_at)
    for i in (i for i, o in outcomes.items() if o == "error_event"):  # each is a router line: who, where, why
        rid, victim_address = out[i]["request_id"], f"127.0.0.1:{victim_port}"
        wait_until(
            lambda: any(
                "WARNING" in line and f"request {rid} failed mid-stream" in line and victim_address in line
                for line in stack.router.lines
            ),
            10,
            f"the router's mid-stream failure line of {rid}",
        )
    retried = _retries(stack.url) - retries_before
    survivor = stack.decodes[1]
    wait_idle(stub(survivor.ports["scheduler"]), 20)

    # The last decode goes: no pair now, whatever succeeded a moment ago.
    ready = f"{stack.url}/ready"
    survivor.kill()
    took_down = wait_status(ready, 503, 15)
    # A new decode on the killed one's port: the router's static node list sees it come back.
    stack.spares.append(decode_node(stack.model, victim_port).wait_ready(120))
    took_up = wait_status(ready, 200, 30)
    c = _client(stack)
    r = c.completions.create(
        model=stack.served_model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    stack.wait_all_idle(20)
    print(
        f"kill: {sorted(outcomes.items())}, {retried:g} retries; /ready 503 after {took_down:.1f} s, "
        f"200 again {took_up:.1f} s after the restart"
    )
