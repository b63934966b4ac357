"""Chat messages checked the way OpenAI checks them, then turned into the dicts chat templates read.

OpenAI refuses, with a 400 that names the exact place (`messages[1].tool_call_id`): keys a role
does not have, an unknown role, a missing or null content (assistant messages excepted when they
carry tool calls), a tool message without `tool_call_id`, empty content arrays and unknown content
part types, a tool message with no assistant `tool_calls` before it. Those checks are mirrored
here. What OpenAI accepts but this service cannot do is refused as unsupported, naming the field:
non-text content parts, the legacy `function_call` (so a function result can never answer one) and
audio references. The extras templates read are kept: `name`, `tool_call_id`, `refusal`,
`tool_calls` (each call's `arguments` given to the template as the object it encodes, as HF
templates expect), and the `reasoning_content` (or `reasoning`) that vLLM accepts on assistant
messages for reasoning models' templates.
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import APIError, bad_request

ROLES = ("system", "assistant", "user", "function", "tool", "developer")  # OpenAI's order, for its message
_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {
        "role",
        "content",
        "name",
        "refusal",
        "tool_calls",
        "function_call",
        "audio",
        "reasoning_content",
        "reasoning",
    },
    "tool": {"role", "content", "tool_call_id"},
    "function": {"role", "content", "name"},
}
_ANY_ROLE_KEYS = frozenset().union(*_KEYS.values())
_PART_TYPES = {  # content part types OpenAI accepts per role
    "system": ("text",),
    "developer": ("text",),
    "tool": ("text",),
    "assistant": ("text", "refusal"),
    "user": ("text", "image_url", "input_audio", "file"),
}
_PART_KEYS = {"text": {"type", "text"}, "refusal": {"type", "refusal"}}
_STRING_KEYS = ("name", "tool_call_id", "refusal", "reasoning_content", "reasoning")
_OPTIONAL = {"refusal", "reasoning_content", "reasoning", "function_call", "tool_calls", "audio"}  # may be null


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), type(v).__name__
    )


def _invalid_type(param: str, expected: str, v: Any) -> APIError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {_type_name(v)} instead.",
        param=param,
        code="invalid_type",
    )


def _missing(param: str) -> APIError:
    return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _unsupported(param: str, message: str) -> APIError:
    return bad_request(message, param=param, code="unsupported_parameter")


def template_messages(raw: list[Any]) -> list[dict[str, Any]]:
    """The messages as template dicts; APIError (400) for the first one OpenAI would refuse."""
    if not raw:
        raise bad_request("'messages' must hold at least one message.", param="messages", code="empty_messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        out.append(_message(m, f"messages[{i}]", any("tool_calls" in o for o in out)))
    return out


def _message(m: Any, at: str, after_calls: bool) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise _invalid_type(at, "an object", m)
    _known(m, _ANY_ROLE_KEYS, at)  # a key no message has (`{"": ""}`) is named before the role is checked
    role = _role(m, at)
    _known(m, _KEYS[role], at)
    for key in _STRING_KEYS:
        if key in m and not isinstance(m[key], str) and not (key in _OPTIONAL and m[key] is None):
            raise _invalid_type(f"{at}.{key}", "a string", m[key])
    if role == "tool" and "tool_call_id" not in m:
        raise _missing(f"{at}.tool_call_id")
    if role == "function" and "name" not in m:
        raise _missing(f"{at}.name")
    content = _content(m, role, at)
    _refuse_unsupported(m, role, at, after_calls)
    out = {k: v for k, v in m.items() if v is not None and k in _STRING_KEYS}
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{at}.tool_calls")
    # "developer" is OpenAI's new name for "system"; open-model templates only know "system".
    out["role"] = "system" if role == "developer" else role
    out["content"] = content
    return out


def _known(obj: dict[str, Any], keys: frozenset[str] | set[str], at: str) -> None:
    for key in obj:
        if key not in keys:
            raise bad_request(f"Unknown parameter: '{at}.{key}'.", param=f"{at}.{key}", code="unknown_parameter")


def _role(m: dict[str, Any], at: str) -> str:
    if "role" not in m:
        raise _missing(f"{at}.role")
    role = m["role"]
    if not isinstance(role, str):
        raise _invalid_type(f"{at}.role", "a string", role)
    if role not in ROLES:
        listed = ", ".join(f"'{r}'" for r in ROLES[:-1]) + f", and '{ROLES[-1]}'"
        raise bad_request(
            f"Invalid value: '{role}'. Supported values are: {listed}.", param=f"{at}.role", code="invalid_value"
        )
    return role


def _content(m: dict[str, Any], role: str, at: str) -> str:
    """The content as one string (text parts joined, as OpenAI's own renderer does)."""
    param = f"{at}.content"
    calls = m.get("tool_calls") or m.get("function_call")
    if "content" not in m:
        if role == "assistant" and calls:
            return ""
        raise _missing(param)
    c = m["content"]
    if c is None:
        if (role == "assistant" and calls) or role == "function":
            return ""
        raise _invalid_type(param, "one of a string or array of objects", c)
    if isinstance(c, str):
        return c
    if role == "function" or not isinstance(c, list):
        raise _invalid_type(param, "a string" if role == "function" else "one of a string or array of objects", c)
    if not c:
        raise bad_request(
            f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an empty array instead.",
            param=param,
            code="empty_array",
        )
    return "".join(_part(p, role, f"{param}[{j}]") for j, p in enumerate(c))


def _part(p: Any, role: str, at: str) -> str:
    if not isinstance(p, dict):
        raise _invalid_type(at, "an object", p)
    if "type" not in p:
        raise _missing(f"{at}.type")
    kind, allowed = p["type"], _PART_TYPES[role]
    if kind not in allowed:
        listed = ", ".join(f"'{t}'" for t in allowed)
        raise bad_request(
            f"Invalid value: '{kind}'. Supported values are: {listed}.", param=f"{at}.type", code="invalid_value"
        )
    if kind not in _PART_KEYS:
        raise bad_request(
            f"'{at}.type': content parts of type '{kind}' are not supported (this service serves a text-only model).",
            param=f"{at}.type",
            code="unsupported_value",
        )
    _known(p, _PART_KEYS[kind], at)
    if kind not in p:
        raise _missing(f"{at}.{kind}")
    if not isinstance(p[kind], str):
        raise _invalid_type(f"{at}.{kind}", "a string", p[kind])
    return p[kind] if kind == "text" else ""  # a refusal part is not model text


def _tool_calls(calls: Any, at: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls as templates read them: arguments decoded when they are JSON."""
    if not isinstance(calls, list):
        raise _invalid_type(at, "an array", calls)
    out = []
    for j, call in enumerate(calls):
        where = f"{at}[{j}]"
        if not isinstance(call, dict):
            raise _invalid_type(where, "an object", call)
        _known(call, {"id", "type", "function"}, where)
        for key in ("id", "type", "function"):
            if key not in call:
                raise _missing(f"{where}.{key}")
        if call["type"] != "function":
            raise bad_request(
                f"Invalid value: {call['type']!r}. Supported values are: 'function'.",
                param=f"{where}.type",
                code="invalid_value",
            )
        fn = call["function"]
        if not isinstance(fn, dict):
            raise _invalid_type(f"{where}.function", "an object", fn)
        _known(fn, {"name", "arguments"}, f"{where}.function")
        for key in ("name", "arguments"):
            if key not in fn:
                raise _missing(f"{where}.function.{key}")
            if not isinstance(fn[key], str):
                raise _invalid_type(f"{where}.function.{key}", "a string", fn[key])
        if not isinstance(call["id"], str):
            raise _invalid_type(f"{where}.id", "a string", call["id"])
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": _args(fn)}})
    return out


def _args(fn: dict[str, Any]) -> Any:
    try:
        decoded = json.loads(fn["arguments"])
    except ValueError:
        return fn["arguments"]  # not JSON: the template gets the text as sent
    return decoded if isinstance(decoded, dict) else fn["arguments"]


def _refuse_unsupported(m: dict[str, Any], role: str, at: str, after_calls: bool) -> None:
    """The legacy function calls and audio are refused; a tool result must answer earlier tool calls."""
    for key in ("function_call", "audio"):
        if m.get(key) is not None:
            what = "audio responses are" if key == "audio" else "the legacy function_call is"
            raise _unsupported(f"{at}.{key}", f"'{at}.{key}': {what} not supported by this service.")
    if role == "function" or (role == "tool" and not after_calls):
        # OpenAI's own rule; with function_call refused above, no message can satisfy it for a function
        raise bad_request(
            f"Invalid parameter: messages with role '{role}' must be a response to a preceding "
            f"message with '{'tool_calls' if role == 'tool' else 'function_call'}'.",
            param=f"{at}.role",
            code="invalid_value",
        )
