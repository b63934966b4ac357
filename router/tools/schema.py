"""A chat request's `tools` and `tool_choice`, checked the way OpenAI checks them.

Only function tools exist here (OpenAI's `custom` and `allowed_tools` shapes are refused as
unsupported). A function's `parameters` must be a valid JSON schema; when it is omitted the
function takes no arguments, as OpenAI reads it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from router.errors import APIError, bad_request
from router.structured import check_json_schema

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    parameters: dict[str, Any]
    strict: bool = False


def _missing(param: str) -> APIError:
    return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _unknown_keys(obj: dict[str, Any], keys: set[str], at: str) -> None:
    for key in obj:
        if key not in keys:
            raise bad_request(f"Unknown parameter: '{at}.{key}'.", param=f"{at}.{key}", code="unknown_parameter")


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"Invalid type for '{param}': expected an object.", param=param, code="invalid_type")
    return value


def functions(tools: list[Any]) -> list[FunctionSpec]:
    """The functions of `tools`; a 400 naming the first bad field."""
    if not tools:
        raise bad_request(
            "Invalid 'tools': empty array. Expected an array with minimum length 1.", param="tools", code="empty_array"
        )
    out: list[FunctionSpec] = []
    for i, tool in enumerate(tools):
        spec = _function(_object(tool, f"tools[{i}]"), f"tools[{i}]")
        if any(f.name == spec.name for f in out):
            raise bad_request(
                f"Invalid 'tools': the function name '{spec.name}' appears twice.",
                param=f"tools[{i}].function.name",
                code="invalid_value",
            )
        out.append(spec)
    return out


def _function(tool: dict[str, Any], at: str) -> FunctionSpec:
    if tool.get("type") != "function":
        raise bad_request(
            f"'{at}.type': only tools of type 'function' are supported.", param=f"{at}.type", code="unsupported_value"
        )
    _unknown_keys(tool, _TOOL_KEYS, at)
    if "function" not in tool:
        raise _missing(f"{at}.function")
    fn = _object(tool["function"], f"{at}.function")
    _unknown_keys(fn, _FUNCTION_KEYS, f"{at}.function")
    if "name" not in fn:
        raise _missing(f"{at}.function.name")
    name = fn["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            f"Invalid '{at}.function.name': {json.dumps(name)}. Expected a string of letters, digits, "
            "underscores or dashes, at most 64 characters.",
            param=f"{at}.function.name",
            code="invalid_value",
        )
    for key, kind in (("description", str), ("strict", bool)):
        if fn.get(key) is not None and not isinstance(fn[key], kind):
            param = f"{at}.function.{key}"
            raise bad_request(f"Invalid type for '{param}'.", param=param, code="invalid_type")
    params = fn.get("parameters")
    if params is None:
        params = NO_PARAMETERS
    else:
        params = json.loads(check_json_schema(params, f"{at}.function.parameters"))
    return FunctionSpec(name, params, bool(fn.get("strict")))


def tool_choice(choice: Any, specs: list[FunctionSpec]) -> str | FunctionSpec:
    """'none', 'auto', 'required', or the named function; a 400 for anything else."""
    if choice is None:
        return "auto" if specs else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad_request(
                f"Invalid value for 'tool_choice': {choice!r}. Supported values are: 'none', 'auto', 'required', "
                "or an object naming a function.",
                param="tool_choice",
                code="invalid_value",
            )
        if choice == "required" and not specs:
            raise _needs_tools()
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise bad_request(
            "'tool_choice': only {'type': 'function', 'function': {'name': ...}} objects are supported.",
            param="tool_choice",
            code="unsupported_value",
        )
    _unknown_keys(choice, {"type", "function"}, "tool_choice")
    fn = _object(choice.get("function"), "tool_choice.function")
    _unknown_keys(fn, {"name"}, "tool_choice.function")
    if not specs:
        raise _needs_tools()
    named = next((f for f in specs if f.name == fn.get("name")), None)
    if named is None:
        raise bad_request(
            f"Invalid 'tool_choice': no function named {json.dumps(fn.get('name'))} in 'tools'.",
            param="tool_choice.function.name",
            code="invalid_value",
        )
    return named


def _needs_tools() -> APIError:
    return bad_request(
        "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
        param="tool_choice",
        code="invalid_value",
    )
