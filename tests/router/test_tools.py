"""Tool calling through the API: each tool_choice's constraint on the node job and its parsed answer,
streamed calls reassembled by the official client equal the non-streamed ones (parallel calls with
distinct indexes), special-token markers, and bad tool requests as clear 400s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from common.sampling import Constraint
from common.tokenizer import Tokenizer
from router.app import RouterApp
from router.contract import GenerationJob
from tests.router.fake_dispatcher import FakeDispatcher, Script, server, sse_lines
from tests.router.test_app import MODEL, check_error

# A Qwen-like template: the tools in a system turn, calls and results in the history.
TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. "
    "Call as <tool_call>{...}</tool_call>{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
U: list[Any] = [{"role": "user", "content": "Weather in Paris and the time?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
TWO_CALLS = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
EXPECTED = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    out = Tokenizer.from_dir(tiny_llama_dir)
    out.set_chat_template(TEMPLATE)
    return out


def make(
    tok: Tokenizer, reply: str = TWO_CALLS, parser: str | None = None, chunk: int = 1
) -> tuple[FastAPI, FakeDispatcher]:
    script: Callable[[GenerationJob], Script] = lambda job: Script(reply=reply, chunk=chunk)  # noqa: E731
    fake = FakeDispatcher(tok, script, max_context_length=512)
    return RouterApp(fake, tok, served_model=MODEL, tool_call_parser=parser).app, fake


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_the_template_shows_hermes_so_auto_parses_calls(tok: Tokenizer) -> None:
    app, fake = make(tok)  # no --tool-call-parser: the template's <tool_call> picks hermes
    with server(app) as url:
        out = client(url).chat.completions.create(model=MODEL, messages=U, tools=TOOLS)  # type: ignore[arg-type]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    assert calls_of(choice.message) == EXPECTED
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
    assert fake.jobs[0].sampling.constraint is None  # auto, no strict tool: unconstrained
    prompt = tok.decode(list(fake.jobs[0].input_ids), skip_special_tokens=False)
    assert "Tools: get_weather get_time." in prompt


def test_none_renders_no_tools_parses_nothing_constrains_nothing(tok: Tokenizer) -> None:
    app, fake = make(tok)
    with server(app) as url:
        out = client(url).chat.completions.create(
            model=MODEL,
            messages=U,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="none",
        )
    assert out.choices[0].message.content == TWO_CALLS and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop" and fake.jobs[0].sampling.constraint is None
    assert "Tools:" not in tok.decode(list(fake.jobs[0].input_ids), skip_special_tokens=False)


def _hermes_call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark(schema: dict[str, Any], parallel: bool) -> str:
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    body = json.dumps(schema, separators=(",", ":"))
    return f'{start}\ncall: "<tool_call>" "\\n" %json {body} "\\n" "</tool_call>"\n'


ANY_OF = {
    "anyOf": [
        _hermes_call("get_weather", WEATHER["function"]["parameters"]),  # type: ignore[index]
        _hermes_call("get_time", {"type": "object", "properties": {}}),
    ]
}
NAMED = _hermes_call("get_weather", WEATHER["function"]["parameters"])  # type: ignore[index]


@pytest.mark.parametrize(
    "choice,parallel,constraint,expected",
    [
        ("auto", None, None, EXPECTED),
        ("required", None, Constraint("ebnf", _lark(ANY_OF, True)), EXPECTED),
        ("required", False, Constraint("ebnf", _lark(ANY_OF, False)), EXPECTED[:1]),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            None,
            Constraint("ebnf", _lark(NAMED, False)),
            EXPECTED[:1],
        ),
    ],
)
def test_each_tool_choice(
    tok: Tokenizer, choice: Any, parallel: bool | None, constraint: Constraint | None, expected: list[Any]
) -> None:
    app, fake = make(tok)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    with server(app) as url:
        out = client(url).chat.completions.create(
            model=MODEL,
            messages=U,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,
            **extra,  # type: ignore[arg-type]
        )
    assert fake.jobs[0].sampling.constraint == constraint
    assert calls_of(out.choices[0].message) == expected and out.choices[0].finish_reason == "tool_calls"


def test_auto_with_a_strict_tool_holds_calls_to_their_schemas(tok: Tokenizer) -> None:
    """Free text, and after each <tool_call> a call: the strict one's parameters, any object for the other
    (tests/router/test_tool_grammars.py runs these grammars in llguidance)."""
    app, fake = make(tok)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]
    r = TestClient(app).post(
        "/v1/chat/completions", json={"model": MODEL, "messages": U, "tools": [strict, TIME], "tool_choice": "auto"}
    )
    assert r.status_code == 200, r.text
    c = fake.jobs[0].sampling.constraint
    assert c is not None and c.kind == "ebnf"
    params = json.dumps(WEATHER["function"]["parameters"], separators=(",", ":"))  # type: ignore[index]
    assert c.spec.splitlines() == [
        "%llguidance {}",
        "start: (tag_0 | tag_1)* TAG_TEXT",
        r"TAG_TEXT: /(.|\n)*/",
        'tag_0_trig[lazy]: TAG_TEXT "<tool_call>"',
        'tag_0: tag_0_trig "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " '
        f'%json {params} "}}\\n" "</tool_call>"',
        'tag_1_trig[lazy]: TAG_TEXT "<tool_call>"',
        'tag_1: tag_1_trig "\\n{\\"name\\": \\"get_time\\", \\"arguments\\": " '
        '%json {"type":"object"} "}\\n" "</tool_call>"',
    ]


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streamed_calls_equal_the_non_streamed_ones(tok: Tokenizer, chunk: int) -> None:
    """Reassembled by the official client (several tokens per event, as speculation delivers them)."""
    app, _ = make(tok, chunk=chunk)
    with server(app) as url:
        c = client(url)
        full = c.chat.completions.create(model=MODEL, messages=U, tools=TOOLS)  # type: ignore[arg-type]
        with c.chat.completions.stream(model=MODEL, messages=U, tools=TOOLS) as stream:  # type: ignore[arg-type]
            final = stream.get_final_completion()
        chunks = list(c.chat.completions.create(model=MODEL, messages=U, tools=TOOLS, stream=True))  # type: ignore[arg-type]
    assert calls_of(final.choices[0].message) == calls_of(full.choices[0].message) == EXPECTED
    assert final.choices[0].message.content == full.choices[0].message.content
    assert final.choices[0].finish_reason == full.choices[0].finish_reason == "tool_calls"
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    firsts = [d for d in deltas if d.id is not None]
    assert [d.index for d in firsts] == [0, 1] and all(d.index is not None for d in deltas)
    assert all(d.type == "function" and d.function and d.function.name for d in firsts)
    assert all(d.type is None and d.function and d.function.name is None for d in deltas if d.id is None)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_raw_stream_chunks_have_openai_shape(tok: Tokenizer) -> None:
    app, _ = make(tok, chunk=4)
    body = {"model": MODEL, "messages": U, "tools": TOOLS, "stream": True}
    events = [json.loads(e) for e in sse_lines(TestClient(app).post("/v1/chat/completions", json=body).text)[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events]
    for d in deltas:
        for tc in d.get("tool_calls", []):
            assert "index" in tc and set(tc) <= {"index", "id", "type", "function"}
        assert "tool_calls" not in d or "content" not in d  # no empty content beside tool calls
    args: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
    assert args == {0: '{"city": "Paris"}', 1: "{}"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_mistral_marker_is_a_special_token(tiny_llama_dir: Path) -> None:
    """[TOOL_CALLS] is a control token: the parser still sees it, and grammars name it by id."""
    mtok = Tokenizer.from_dir(tiny_llama_dir)
    mtok.backend.add_special_tokens(["[TOOL_CALLS]"])
    tid = mtok.token_to_id("[TOOL_CALLS]")
    ids = [tid, *mtok.encode('[{"name": "get_time", "arguments": {}}]', add_special_tokens=False)]
    fake = FakeDispatcher(mtok, lambda job: Script(tokens=ids), max_context_length=512)
    app = RouterApp(fake, mtok, served_model=MODEL, tool_call_parser="mistral").app
    body = {"model": MODEL, "messages": U, "tools": TOOLS, "tool_choice": "required"}
    r = TestClient(app).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_time", "arguments": "{}"}]
    assert len(message["tool_calls"][0]["id"]) == 9 and message["content"] is None
    c = fake.jobs[0].sampling.constraint
    assert c is not None and c.kind == "ebnf" and c.spec.startswith(f"start: <[{tid}]> %json ")


def test_a_tool_round_trip(tok: Tokenizer) -> None:
    """The answer's calls go back as history with the tool's result; the template renders both."""
    app, fake = make(tok, reply="It is sunny.")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*U, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    with server(app) as url:
        out = client(url).chat.completions.create(model=MODEL, messages=history, tools=TOOLS)  # type: ignore[arg-type]
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].finish_reason == "stop"
    prompt = tok.decode(list(fake.jobs[0].input_ids), skip_special_tokens=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|tool|>sunny" in prompt


BAD: list[tuple[dict[str, Any], str, str]] = [  # fields, param, code
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        "invalid_value",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": []}, "tools", "empty_array"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "unsupported_value"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
        "tools[0].function.parameters",
        "invalid_json_schema",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "conflicting_constraints",
    ),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"function_call": "auto"}, "function_call", "unsupported_parameter"),
]


@pytest.mark.parametrize("fields,param,code", BAD)
def test_bad_tool_requests_are_clear_400s(tok: Tokenizer, fields: dict[str, Any], param: str, code: str) -> None:
    app, fake = make(tok)
    c = TestClient(app)
    check_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": U, **fields}), 400, param, code)
    assert not fake.jobs and c.get("/health").status_code == 200
    ok = c.post("/v1/chat/completions", json={"model": MODEL, "messages": U, "tools": TOOLS})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_unknown_function_through_the_client(tok: Tokenizer) -> None:
    app, _ = make(tok)
    with server(app) as url:
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(
                model=MODEL,
                messages=U,
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice={"type": "function", "function": {"name": "launch"}},
            )
    assert e.value.param == "tool_choice.function.name" and "launch" in e.value.message


def test_each_choice_has_its_own_parser(tok: Tokenizer) -> None:
    """n choices, streamed: each reassembles its own calls, indexes counted per choice."""
    app, _ = make(tok, chunk=2)
    body = {"model": MODEL, "messages": U, "tools": TOOLS, "stream": True, "n": 2}
    events = [json.loads(e) for e in sse_lines(TestClient(app).post("/v1/chat/completions", json=body).text)[:-1]]
    names: dict[int, list[str]] = {0: [], 1: []}
    for e in events:
        for c in e["choices"]:
            names[c["index"]] += [tc["function"]["name"] for tc in c["delta"].get("tool_calls", []) if "id" in tc]
    assert names == {0: ["get_weather", "get_time"], 1: ["get_weather", "get_time"]}
