"""Structured output and tool calls end to end: the official client against a real PD stack (router,
prefill, decode; the built-in pair with EAGLE), so the router's constraints are compiled and obeyed
by the nodes' grammar engine across the handoff and under speculation. Greedy, so streamed and
non-streamed answers are the same answer. Every wait is bounded; every process is killed."""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Literal

import openai
import pytest
from pydantic import BaseModel

from engine.kv_transfer import nixl_available
from tests.router.stack import Stack, running_stack

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]

U: list[Any] = [{"role": "user", "content": "def fibonacci(n):"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    count: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(None, decodes=1, router_args=("--tool-call-parser", "hermes")) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_parse_returns_the_model_object(client: openai.OpenAI, stack: Stack) -> None:
    kw: dict[str, Any] = {"model": stack.served_model, "messages": U, "temperature": 0, "max_tokens": 64}
    out = client.chat.completions.parse(response_format=Verdict, **kw)
    assert isinstance(out.choices[0].message.parsed, Verdict), out.choices[0].message.content
    with client.chat.completions.stream(response_format=Verdict, **kw) as s:
        streamed = s.get_final_completion()
    assert streamed.choices[0].message.parsed == out.choices[0].message.parsed


def test_regex_and_choice_on_completions(client: openai.OpenAI, stack: Stack) -> None:
    kw: dict[str, Any] = {"model": stack.served_model, "prompt": "x = ", "temperature": 0, "max_tokens": 16}
    digits = client.completions.create(**kw, extra_body={"regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text), digits.choices[0].text
    picked = client.completions.create(**kw, stream=True, extra_body={"guided_choice": ["alpha", "beta"]})
    assert "".join(c.choices[0].text for c in picked if c.choices) in ("alpha", "beta")


def test_required_tool_call_streamed_equals_non_streamed(client: openai.OpenAI, stack: Stack) -> None:
    kw: dict[str, Any] = {
        "model": stack.served_model,
        "messages": U,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 64,
    }
    full = client.chat.completions.create(**kw)
    calls = full.choices[0].message.tool_calls or []
    assert full.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")
    with client.chat.completions.stream(**kw) as s:
        streamed = s.get_final_completion()
    got = [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []]
    assert got == [(c.function.name, c.function.arguments) for c in calls]
    assert streamed.choices[0].finish_reason == "tool_calls"
    stack.wait_all_idle(10)
