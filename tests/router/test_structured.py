"""Structured output through the API: response_format and the vLLM/SGLang extensions each become the
one Constraint the nodes get, on chat and completions, streamed or not; the official client's
`parse` returns the parsed object; bad schemas and two constraints at once are clear 400s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from common.sampling import Constraint
from common.tokenizer import Tokenizer
from tests.router.fake_dispatcher import Script, server
from tests.router.test_app import MODEL, check_error, make

U: list[Any] = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
COMPACT = json.dumps(SCHEMA, separators=(",", ":"))
GRAMMAR = 'start: "yes" | "no"'
TAG = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}

# request fields -> the constraint the nodes get
ACCEPTED: list[tuple[dict[str, Any], Constraint]] = [
    ({"guided_json": SCHEMA}, Constraint("json_schema", COMPACT)),
    ({"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", COMPACT)),
    ({"json_schema": json.dumps(SCHEMA)}, Constraint("json_schema", COMPACT)),
    ({"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
    ({"regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no way", "a.b"]}, Constraint("regex", "(yes|no way|a\\.b)")),
    ({"guided_grammar": GRAMMAR}, Constraint("ebnf", GRAMMAR)),
    ({"ebnf": GRAMMAR}, Constraint("ebnf", GRAMMAR)),
    ({"structural_tag": json.dumps(TAG)}, Constraint("structural_tag", json.dumps(TAG))),
    ({"structural_tag": TAG}, Constraint("structural_tag", json.dumps(TAG))),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", COMPACT)),
    ({"structured_outputs": {"choice": ["a", "b"]}}, Constraint("regex", "(a|b)")),
    ({"structured_outputs": {"grammar": GRAMMAR}}, Constraint("ebnf", GRAMMAR)),
    ({"response_format": {"type": "json_object"}}, Constraint("json_schema", '{"type":"object"}')),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True}}},
        Constraint("json_schema", COMPACT),
    ),
    ({"response_format": {"type": "text"}}, None),  # type: ignore[list-item]
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.mark.parametrize("fields,constraint", ACCEPTED)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_each_field_becomes_the_constraint(
    tok: Tokenizer, fields: dict[str, Any], constraint: Constraint | None, path: str, stream: bool
) -> None:
    app, fake = make(tok, lambda job: Script(reply='{"a": 1}'))
    body = {"model": MODEL, "stream": stream, "n": 2, **fields}
    body.update({"messages": U} if "chat" in path else {"prompt": "x"})
    r = TestClient(app).post(path, json=body)
    assert r.status_code == 200, r.text
    assert [j.sampling.constraint for j in fake.jobs] == [constraint, constraint]


class Answer(BaseModel):
    city: str
    population: int


def test_the_openai_client_parses_structured_output(tok: Tokenizer) -> None:
    app, fake = make(tok, lambda job: Script(reply='{"city": "Paris", "population": 2100000}'))
    with server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        out = client.chat.completions.parse(model=MODEL, messages=U, response_format=Answer)
        assert out.choices[0].message.parsed == Answer(city="Paris", population=2100000)
        with client.chat.completions.stream(model=MODEL, messages=U, response_format=Answer) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].message.parsed == Answer(city="Paris", population=2100000)
    for job in fake.jobs:
        c = job.sampling.constraint
        assert c is not None and c.kind == "json_schema"
        schema = json.loads(c.spec)
        assert schema["properties"]["population"] == {"title": "Population", "type": "integer"}
        assert schema["required"] == ["city", "population"] and schema["additionalProperties"] is False


BAD: list[tuple[dict[str, Any], str, str]] = [  # fields, param, code
    ({"guided_json": {"type": "objekt"}}, "guided_json", "invalid_json_schema"),
    ({"guided_json": "{not json"}, "guided_json", "invalid_json_schema"),
    ({"guided_json": [1]}, "guided_json", "invalid_json_schema"),
    ({"guided_json": {"properties": {"a": {"minimum": "zero"}}}}, "guided_json", "invalid_json_schema"),
    ({"regex": ""}, "regex", "invalid_type"),
    ({"structural_tag": "{not json"}, "structural_tag", "invalid_value"),
    ({"structural_tag": [TAG]}, "structural_tag", "invalid_type"),
    (
        {"structural_tag": {"structures": [{"begin": "<f>", "schema": {"type": 1}, "end": "</f>"}]}},
        "structural_tag.structures[0].schema",
        "invalid_json_schema",
    ),
    ({"guided_choice": []}, "guided_choice", "invalid_value"),
    ({"guided_choice": ["a", 3]}, "guided_choice", "invalid_value"),
    ({"regex": "a", "ebnf": GRAMMAR}, "ebnf", "conflicting_constraints"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "conflicting_constraints"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex", "conflicting_constraints"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", None),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema", "unknown_parameter"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema.name",
        "missing_required_parameter",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": {"type": 3}}}},
        "response_format.json_schema.schema",
        "invalid_json_schema",
    ),
]


@pytest.mark.parametrize("fields,param,code", BAD)
def test_bad_constraints_are_clear_400s_and_the_server_stays_healthy(
    tok: Tokenizer, fields: dict[str, Any], param: str, code: str | None
) -> None:
    app, fake = make(tok)
    client = TestClient(app)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": U, **fields})
    check_error(r, 400, param, code)
    assert param.split(".")[0] in r.json()["error"]["message"] and not fake.jobs
    if "response_format" not in fields:  # the same on completions
        check_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **fields}), 400, param, code)
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200


def test_a_bad_schema_names_the_problem(tok: Tokenizer) -> None:
    app, _ = make(tok)
    with server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                messages=U,
                response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": {"type": "objekt"}}},
            )
    assert e.value.code == "invalid_json_schema" and "'objekt' is not valid" in e.value.message
    assert "at type" in e.value.message
