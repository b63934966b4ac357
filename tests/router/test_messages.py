"""Chat messages are checked the way OpenAI checks them: every refusal is a 400 that names the exact
place (`messages[1].tool_call_id`) with OpenAI's code; what OpenAI accepts reaches the template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from common.tokenizer import Tokenizer
from tests.router.fake_dispatcher import server
from tests.router.test_app import MODEL, check_error, make

U = {"role": "user", "content": "hi"}
CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]

REFUSED: list[tuple[list[Any], str, str]] = [  # messages, param, code
    ([{"": ""}], "messages[0].", "unknown_parameter"),
    ([{"role": "user", "content": "hi", "foo": 1}], "messages[0].foo", "unknown_parameter"),
    ([U, {"role": "assistant", "content": "x", "tool_call_id": "a"}], "messages[1].tool_call_id", "unknown_parameter"),
    ([{"role": "tool", "tool_call_id": "a", "content": "x", "name": "n"}], "messages[0].name", "unknown_parameter"),
    (["hi"], "messages[0]", "invalid_type"),
    ([{"content": "x"}], "messages[0].role", "missing_required_parameter"),
    ([{"role": 5, "content": "x"}], "messages[0].role", "invalid_type"),
    ([{"role": "robot", "content": "x"}], "messages[0].role", "invalid_value"),
    ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "system"}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "developer", "content": None}], "messages[0].content", "invalid_type"),
    ([{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
    ([{"role": "user", "content": []}], "messages[0].content", "empty_array"),
    ([{"role": "user", "content": "x", "name": 5}], "messages[0].name", "invalid_type"),
    ([U, {"role": "assistant"}], "messages[1].content", "missing_required_parameter"),
    ([U, {"role": "assistant", "content": None}], "messages[1].content", "invalid_type"),
    ([U, {"role": "tool", "content": "x"}], "messages[1].tool_call_id", "missing_required_parameter"),
    ([U, {"role": "tool", "tool_call_id": "a"}], "messages[1].content", "missing_required_parameter"),
    ([U, {"role": "tool", "tool_call_id": 7, "content": "x"}], "messages[1].tool_call_id", "invalid_type"),
    ([U, {"role": "function", "content": "x"}], "messages[1].name", "missing_required_parameter"),
    # content parts
    ([{"role": "user", "content": [{"text": "a"}]}], "messages[0].content[0].type", "missing_required_parameter"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "missing_required_parameter"),
    (
        [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}],
        "messages[0].content[0].x",
        "unknown_parameter",
    ),
    ([{"role": "user", "content": [{"type": "video", "video": "a"}]}], "messages[0].content[0].type", "invalid_value"),
    (
        [{"role": "system", "content": [{"type": "refusal", "refusal": "no"}]}],
        "messages[0].content[0].type",
        "invalid_value",
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        "messages[0].content[0].type",
        "unsupported_value",
    ),
    # tool calls are checked as OpenAI checks them; the legacy function_call stays unsupported
    (
        [U, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]}],
        "messages[1].tool_calls[0].function.arguments",
        "missing_required_parameter",
    ),
    ([U, {"role": "assistant", "tool_calls": {"id": "c1"}}], "messages[1].tool_calls", "invalid_type"),
    (
        [U, {"role": "assistant", "tool_calls": [{**CALL[0], "type": "custom"}]}],
        "messages[1].tool_calls[0].type",
        "invalid_value",
    ),
    (
        [U, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
        "messages[1].function_call",
        "unsupported_parameter",
    ),
    # a tool result answers an earlier assistant message's tool calls
    ([U, {"role": "tool", "tool_call_id": "c1", "content": "42"}], "messages[1].role", "invalid_value"),
    ([U, {"role": "function", "name": "f", "content": "42"}], "messages[1].role", "invalid_value"),
    ([U, {"role": "assistant", "content": "x", "audio": {"id": "a1"}}], "messages[1].audio", "unsupported_parameter"),
]


@pytest.mark.parametrize("messages,param,code", REFUSED)
def test_refused_like_openai(tok: Tokenizer, messages: list[Any], param: str, code: str) -> None:
    app, fake = make(tok)
    r = TestClient(app).post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    check_error(r, 400, param, code)
    assert param in r.json()["error"]["message"] or code == "invalid_value"
    assert not fake.jobs


def test_accepted_shapes_reach_the_template(tok: Tokenizer) -> None:
    app, fake = make(tok)
    messages = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "name": "ops",
        },
        {"role": "user", "content": "", "name": "ann"},  # empty content is content
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "ok"}, {"type": "refusal", "refusal": "no"}],
            "refusal": None,
            "reasoning_content": "thought",
            "name": "bot",
        },
        {"role": "user", "content": [{"type": "text", "text": "again"}]},
    ]
    r = TestClient(app).post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    rendered = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ]
    )
    assert fake.jobs[0].input_ids == tuple(tok.encode(rendered, add_special_tokens=False))


def test_a_tool_round_trip_reaches_the_template(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Assistant tool calls (arguments decoded, as HF templates read them) and the tool's answer."""
    app, fake = make(tok)
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    messages = [U, {"role": "assistant", "content": None, "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": "c1", "content": "42"}]
    seen: list[Any] = []
    monkeypatch.setattr(tok, "apply_chat_template", lambda m, *a, **k: seen.append(m) or "x")
    r = TestClient(app).post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    assert seen[0][1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
    ]
    assert seen[0][2] == {"role": "tool", "tool_call_id": "c1", "content": "42"}


def test_openai_client_gets_typed_errors(tok: Tokenizer) -> None:
    app, _ = make(tok)
    with server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        cases = [
            ([{"role": "user", "content": "hi", "foo": 1}], "messages[0].foo", "unknown_parameter"),
            ([U, {"role": "tool", "content": "x"}], "messages[1].tool_call_id", "missing_required_parameter"),
            ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ]
        for messages, param, code in cases:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
            assert (e.value.param, e.value.code, e.value.type) == (param, code, "invalid_request_error")


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)
