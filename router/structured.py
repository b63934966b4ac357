"""Structured output: the request fields that constrain the output, turned into one `Constraint`.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` and `structured_outputs`, and SGLang's `json_schema`, `regex`,
`ebnf` and `structural_tag`. JSON schemas are checked against their metaschema here (a bad one is
a 400 naming the problem); regexes and grammars are compiled by the nodes, which refuse what their
grammar engine cannot build. A request may set one of them at most.

`json_schema` constraints apply whatever `strict` says (as vLLM and SGLang do): a schema given is
a schema followed.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from common.sampling import Constraint
from router.errors import APIError, bad_request

ANY_OBJECT = '{"type":"object"}'
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# vLLM's structured_outputs keys, by the constraint they ask for
_STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "ebnf",
    "structural_tag": "structural_tag",
}
# Characters a regex gives a meaning to; everything else stands for itself (Rust's regex syntax,
# which the nodes' grammar engine uses, accepts these escapes).
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def check_json_schema(schema: Any, param: str) -> str:
    """The schema as compact JSON text; a 400 naming the first metaschema violation."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _invalid(param, f"the schema is not valid JSON ({e})") from e
    if not isinstance(schema, dict):
        raise _invalid(param, "a JSON schema must be an object")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the schema's root"
        raise _invalid(param, f"{e.message} (at {where})") from e
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _invalid(param: str, why: str) -> APIError:
    return bad_request(f"Invalid JSON schema in '{param}': {why}.", param=param, code="invalid_json_schema")


def _need_str(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string.", param=param, code="invalid_type")
    return value


def response_format(rf: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in _RESPONSE_FORMATS:
        allowed = ", ".join(f"'{k}'" for k in _RESPONSE_FORMATS)
        raise bad_request(
            f"Invalid value for 'response_format.type': {kind!r}. Supported values are: {allowed}.",
            param="response_format.type",
            code="invalid_value",
        )
    expected = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    for key in rf:
        if key not in expected:
            param = f"response_format.{key}"
            raise bad_request(f"Unknown parameter: '{param}'.", param=param, code="unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", ANY_OBJECT)
    return Constraint("json_schema", _json_schema_format(rf.get("json_schema")))


def _json_schema_format(spec: Any) -> str:
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    for key in spec:
        if key not in _JSON_SCHEMA_KEYS:
            raise bad_request(f"Unknown parameter: '{param}.{key}'.", param=f"{param}.{key}", code="unknown_parameter")
    if "name" not in spec:
        raise bad_request(
            f"Missing required parameter: '{param}.name'.", param=f"{param}.name", code="missing_required_parameter"
        )
    _need_str(spec["name"], f"{param}.name")
    if spec.get("strict") not in (None, True, False):
        raise bad_request(f"'{param}.strict' must be a boolean.", param=f"{param}.strict", code="invalid_type")
    if spec.get("schema") is None:
        return ANY_OBJECT  # OpenAI's schema is optional: then any JSON object
    return check_json_schema(spec["schema"], f"{param}.schema")


def choice_regex(choices: Any, param: str) -> str:
    """guided_choice: exactly one of the strings, as a regex alternation."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        why = f"'{param}' must be a non-empty list of non-empty strings."
        raise bad_request(why, param=param, code="invalid_value")
    return "(" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in s) for s in choices) + ")"


def _one(kind: str, value: Any, param: str) -> Constraint:
    """The constraint one extension field asks for (kind: json_schema, regex, choice, ebnf, structural_tag)."""
    if kind == "json_schema":
        return Constraint("json_schema", check_json_schema(value, param))
    if kind == "choice":
        return Constraint("regex", choice_regex(value, param))
    if kind == "structural_tag":
        return Constraint("structural_tag", _structural_tag(value, param))
    return Constraint(kind, _need_str(value, param))


def _structural_tag(value: Any, param: str) -> str:
    """SGLang's structural tag as JSON text: an object whose structures' schemas are valid."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"'{param}' is not valid JSON ({e}).", param=param, code="invalid_value") from e
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be a JSON object.", param=param, code="invalid_type")
    structures = value.get("structures", [])
    for k, s in enumerate(structures if isinstance(structures, list) else []):
        if isinstance(s, dict) and "schema" in s:
            check_json_schema(s["schema"], f"{param}.structures[{k}].schema")
    return json.dumps(value, ensure_ascii=False)


# extension field -> the kind of constraint it asks for
EXTENSION_FIELDS = {
    "guided_json": "json_schema",
    "json_schema": "json_schema",
    "guided_regex": "regex",
    "regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "ebnf",
    "ebnf": "ebnf",
    "structural_tag": "structural_tag",
}


def _structured_outputs(value: Any) -> list[tuple[str, Constraint]]:
    """vLLM's structured_outputs object: {"json" | "regex" | "choice" | "grammar": ...}."""
    if not isinstance(value, dict):
        raise bad_request("'structured_outputs' must be an object.", param="structured_outputs", code="invalid_type")
    out = []
    for key, v in value.items():
        param = f"structured_outputs.{key}"
        if key not in _STRUCTURED_OUTPUTS:
            raise bad_request(
                f"'{param}' is not supported (supported: json, regex, choice, grammar, structural_tag).",
                param=param,
                code="unsupported_parameter",
            )
        if v is not None:
            out.append((param, _one(_STRUCTURED_OUTPUTS[key], v, param)))
    return out


def request_constraints(req: Any) -> list[tuple[str, Constraint]]:
    """(param, constraint) for every constraining field the request sets."""
    found = []
    if (c := response_format(getattr(req, "response_format", None))) is not None:
        found.append(("response_format", c))
    for name, kind in EXTENSION_FIELDS.items():
        if (value := getattr(req, name)) is not None:
            found.append((name, _one(kind, value, name)))
    if req.structured_outputs is not None:
        found += _structured_outputs(req.structured_outputs)
    return found


def single(found: list[tuple[str, Constraint]]) -> Constraint | None:
    """The request's one constraint; a 400 naming both when it sets two."""
    if len(found) > 1:
        (a, _), (b, _) = found[:2]
        raise bad_request(
            f"'{a}' and '{b}' both constrain the output; a request may set only one of them.",
            param=b,
            code="conflicting_constraints",
        )
    return found[0][1] if found else None
