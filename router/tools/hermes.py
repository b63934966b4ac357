"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, repeated."""

from __future__ import annotations

from typing import Any

from common.sampling import Constraint
from router.tools import grammar
from router.tools.base import WS, ToolParser
from router.tools.schema import FunctionSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)
    between = (WS, (CLOSE, True), WS, OPEN, WS)
    template_hints = (OPEN,)

    @classmethod
    def required_constraint(cls, functions: list[FunctionSpec], parallel: bool, token_id: Any) -> Constraint:
        call = grammar.lark_json(grammar.calls_schema(functions, "arguments"))
        return grammar.lark(
            'start: call ("\\n" call)*' if parallel else "start: call",
            f"call: {grammar.lark_string(OPEN + chr(10))} {call} {grammar.lark_string(chr(10) + CLOSE)}",
        )

    @classmethod
    def auto_constraint(cls, functions: list[FunctionSpec]) -> Constraint:
        return grammar.structural_tag(
            functions, lambda name: f'{OPEN}\n{{"name": "{name}", "arguments": ', "}\n" + CLOSE, OPEN
        )
