"""The API's edges through a real PD stack (router, prefill, decode on loopback; the built-in pair with
EAGLE): vLLM/SGLang fields honoured end to end, OpenAI-strict messages, and a client that hangs up
while sending its body. Every wait is bounded; every process is killed at the end."""

from __future__ import annotations

import socket
import time
import urllib.request
from typing import Any, Iterator

import httpx
import openai
import pytest

from engine.kv_transfer import nixl_available
from tests.router.stack import Stack, running_stack

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]

# The built-in model ends this file at once: greedy, its first token is EOS.
ENDS_AT_ONCE = 'if __name__ == "__main__":\n    unittest.main()\n'


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(None, decodes=1) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)


def _metric(url: str, needle: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(needle))


def test_min_tokens_holds_eos_back(client: openai.OpenAI, stack: Stack) -> None:
    kw: dict[str, Any] = {"model": stack.served_model, "prompt": ENDS_AT_ONCE, "max_tokens": 24, "temperature": 0}
    free = client.completions.create(**kw)
    assert (free.choices[0].finish_reason, free.usage.completion_tokens, free.choices[0].text) == ("stop", 1, "")
    held = client.completions.create(**kw, extra_body={"min_tokens": 8})
    assert held.usage.completion_tokens >= 8 and held.choices[0].text
    streamed = list(client.completions.create(**kw, stream=True, extra_body={"min_tokens": 8}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == held.choices[0].text
    # min_tokens equal to max_tokens: EOS can never come, the request runs to its length
    full = client.completions.create(**{**kw, "max_tokens": 8}, extra_body={"min_tokens": 8})
    assert (full.choices[0].finish_reason, full.usage.completion_tokens) == ("length", 8)


def test_top_k_1_is_greedy_and_special_tokens_show_when_asked(client: openai.OpenAI, stack: Stack) -> None:
    kw: dict[str, Any] = {"model": stack.served_model, "max_tokens": 16}
    greedy = client.completions.create(prompt="def add(a, b):", temperature=0, **kw)
    top1 = client.completions.create(prompt="def add(a, b):", temperature=1.0, seed=3, extra_body={"top_k": 1}, **kw)
    assert top1.choices[0].text == greedy.choices[0].text
    # ignore_eos: EOS is generated and not an end; its text shows only with skip_special_tokens false
    kw.update(prompt=ENDS_AT_ONCE, temperature=0)
    hidden = client.completions.create(**kw, extra_body={"ignore_eos": True})
    shown = client.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert shown.choices[0].text.startswith("<|eos|>") and "<|" not in hidden.choices[0].text
    assert hidden.usage.completion_tokens == shown.usage.completion_tokens == 16


def test_chat_fields_and_strict_messages(client: openai.OpenAI, stack: Stack) -> None:
    model = stack.served_model
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=4,
        temperature=0,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "stop_token_ids": [7],
        },
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 4
    cont = client.chat.completions.create(
        model=model,
        max_tokens=4,
        temperature=0,
        messages=[{"role": "user", "content": "Write it."}, {"role": "assistant", "content": "def add(a, b):"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )
    assert (cont.choices[0].message.content or "").startswith("def add(a, b):")
    with pytest.raises(openai.BadRequestError) as e:
        bad: list[Any] = [{"role": "user", "content": "hi", "foo": 1}]
        client.chat.completions.create(model=model, messages=bad)
    assert (e.value.param, e.value.code) == ("messages[0].foo", "unknown_parameter")
    with httpx.Client(base_url=stack.url, timeout=30) as h:  # what the typed client will not send
        r2 = h.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "tool", "content": "x"}]})
        assert r2.status_code == 400 and r2.json()["error"]["param"] == "messages[0].tool_call_id"
        r3 = h.post("/v1/completions", json={"model": model, "prompt": "x", "guided_json": {"type": "objekt"}})
        assert r3.status_code == 400 and r3.json()["error"]["param"] == "guided_json"
    stack.wait_all_idle(10)


def test_a_client_leaving_while_sending_its_body_is_one_line(stack: Stack) -> None:
    host, port = "127.0.0.1", stack.router.ports["http"]
    before = _metric(stack.url, 'pdserve_router_client_disconnects_total{stage="body"}')
    start = len(stack.router.lines)
    for _ in range(3):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000000\r\n\r\n{"model": "pyco'
            )
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while _metric(stack.url, 'pdserve_router_client_disconnects_total{stage="body"}') < before + 3:
        assert time.monotonic() < deadline, stack.router.lines[start:]
        time.sleep(0.1)
    time.sleep(0.5)  # anything logged late would show now
    logged = stack.router.lines[start:]
    assert sum("client disconnected while sending its request body" in line for line in logged) == 3, logged
    assert not any("Traceback" in line or "ClientDisconnect" in line or "ERROR" in line for line in logged), logged
    assert _metric(stack.url, 'pdserve_router_requests_total{endpoint="/v1/chat/completions",status="500"}') == 0


def test_a_follow_up_turn_reports_its_cached_prompt_tokens(client: openai.OpenAI, stack: Stack) -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens, from the node that ran the prompt."""
    messages: list[Any] = [{"role": "user", "content": "def fibonacci(n):\n    " * 6}]
    first = client.chat.completions.create(model=stack.served_model, messages=messages, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and now in C"},
    ]
    stream = client.chat.completions.create(
        model=stack.served_model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    # the prefill node cached the first turn's prompt: at least its whole pages come back
    assert usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // 4 - 1) * 4
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
