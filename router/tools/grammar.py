"""The constraints tool calling sends to the nodes, in the grammar languages their engine (llguidance) reads.

- A JSON schema per call: `{"name": {"const": NAME}, ARGS_KEY: <the function's parameters>}`, both
  required, nothing else; several functions are an `anyOf`.
- `required` and named choices: the whole output is the format's call section. Pure JSON formats
  get a `json_schema` constraint; formats with marker text get an `ebnf` constraint, a Lark grammar
  whose call objects are `%json {schema}` (llguidance embeds a JSON schema that way).
- `auto` with a `strict` tool: an `ebnf` constraint in the shape of llguidance's structural tags:
  free text, and each call, once its trigger appears, held to its schema up to its end text.
  Strict functions are held to their parameters, the others to any JSON object.

A marker the vocabulary holds as one token is written `<[id]>`: llguidance treats added tokens as
special, and a special token never matches the text of a string literal, so a literal
"<tool_call>" would ban the very token the model emits.

These Lark grammars are llguidance's (the nodes' default backend); xgrammar's EBNF has no `%json`,
so nodes run with `--grammar-backend xgrammar` refuse them with a 400 naming the constraint.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from common.sampling import Constraint
from router.tools.schema import FunctionSpec

ANY_OBJECT: dict[str, Any] = {"type": "object"}
TokenId = Callable[[str], int | None]


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
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal has JSON's escapes


def marker(text: str, token_id: TokenId) -> str:
    """A marker in Lark: its token when the vocabulary holds it as one, else its text."""
    tid = token_id(text)
    return f"<[{tid}]>" if tid is not None else lark_string(text)


def json_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", _compact(schema))


def lark(*rules: str) -> Constraint:
    return Constraint("ebnf", "\n".join(rules) + "\n")


def free_text_with_calls(fns: list[FunctionSpec], trigger: str, body: Callable[[FunctionSpec, str], str]) -> Constraint:
    """Free text and calls: `trigger` (a Lark item) opens a call, `body(fn, schema)` the rest of it.

    After a token trigger the text before it cannot contain it, so the split is plain; a text
    trigger is a lazy lexeme (the text ends at its first occurrence), as llguidance's structural
    tags do it."""
    tags = [f"tag_{i}" for i in range(len(fns))]
    rules = ["%llguidance {}", f"start: ({' | '.join(tags)})* TAG_TEXT", r"TAG_TEXT: /(.|\n)*/"]
    for tag, fn in zip(tags, fns):
        rest = body(fn, lark_json(fn.parameters if fn.strict else ANY_OBJECT))
        if trigger.startswith("<["):
            rules.append(f"{tag}: TAG_TEXT {trigger} {rest}")
        else:
            rules += [f"{tag}_trig[lazy]: TAG_TEXT {trigger}", f"{tag}: {tag}_trig {rest}"]
    return lark(*rules)


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
