"""The constraints tool calling sends to the nodes, in the shapes their grammar engine (llguidance) reads.

- A JSON schema per call: `{"name": {"const": NAME}, ARGS_KEY: <the function's parameters>}`, both
  required, nothing else; several functions are an `anyOf`.
- `required` and named choices: the whole output is the format's call section. Pure JSON formats
  get a `json_schema` constraint; formats with marker text get an `ebnf` constraint, a Lark grammar
  whose call objects are `%json {schema}` (llguidance embeds a JSON schema that way) and whose
  special-token markers are `<[token id]>`.
- `auto` with a `strict` tool: a `structural_tag` in SGLang's shape (`{"structures": [{"begin",
  "schema", "end"}], "triggers": [...]}`): free text, and each call, once its trigger appears, held
  to its schema. Strict functions are held to their parameters, the others to any JSON object.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from common.sampling import Constraint
from router.tools.schema import FunctionSpec

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(fn: FunctionSpec, args_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, args_key: fn.parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def calls_schema(fns: list[FunctionSpec], args_key: str) -> dict[str, Any]:
    """One call of any of `fns`."""
    schemas = [call_schema(f, args_key) for f in fns]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def array_schema(fns: list[FunctionSpec], args_key: str, parallel: bool) -> dict[str, Any]:
    """A JSON array of one call (with `parallel`, one or more)."""
    out = {"type": "array", "items": calls_schema(fns, args_key), "minItems": 1}
    return out if parallel else {**out, "maxItems": 1}


def lark_json(schema: dict[str, Any]) -> str:
    return "%json " + _compact(schema)


def lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal has JSON's escapes


def marker_token(marker: str, token_id: Callable[[str], int | None]) -> str:
    """A marker in Lark: its token when the vocabulary has it as one (special tokens are matched by
    id, never by their text), else its text."""
    tid = token_id(marker)
    return f"<[{tid}]>" if tid is not None else lark_string(marker)


def json_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", _compact(schema))


def lark(*rules: str) -> Constraint:
    return Constraint("ebnf", "\n".join(rules) + "\n")


def structural_tag(fns: list[FunctionSpec], begin: Callable[[str], str], end: str, trigger: str) -> Constraint:
    structures = [{"begin": begin(f.name), "schema": f.parameters if f.strict else ANY_OBJECT, "end": end} for f in fns]
    return Constraint("structural_tag", _compact({"structures": structures, "triggers": [trigger]}))


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
