"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, with 9-character ids."""

from __future__ import annotations

from typing import Any

from common.sampling import Constraint
from router.tools import grammar
from router.tools.base import WS, ToolParser
from router.tools.schema import FunctionSpec

TOOL_CALLS = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    first = (WS, "[", WS)
    between = (WS, ",", WS)
    template_hints = (TOOL_CALLS,)
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token
    id_prefix, id_length = "", 9  # Mistral's templates refuse other ids in the history

    @classmethod
    def required_constraint(cls, functions: list[FunctionSpec], parallel: bool, token_id: Any) -> Constraint:
        calls = grammar.lark_json(grammar.array_schema(functions, "arguments", parallel))
        return grammar.lark(f"start: {grammar.marker_token(TOOL_CALLS, token_id)} {calls}")

    @classmethod
    def auto_constraint(cls, functions: list[FunctionSpec]) -> Constraint:
        return grammar.structural_tag(
            functions, lambda name: f'{TOOL_CALLS}[{{"name": "{name}", "arguments": ', "}]", TOOL_CALLS
        )
