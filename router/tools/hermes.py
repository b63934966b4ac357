"""Hermes / Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, repeated."""

from __future__ import annotations

from common.sampling import Constraint
from router.tools import grammar
from router.tools.base import WS, ToolParser
from router.tools.grammar import TokenId
from router.tools.schema import FunctionSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN,)
    between = (WS, (CLOSE, True), WS, OPEN, WS)
    template_hints = (OPEN,)

    @classmethod
    def required_constraint(cls, functions: list[FunctionSpec], parallel: bool, token_id: TokenId) -> Constraint:
        call = grammar.lark_json(grammar.calls_schema(functions, "arguments"))
        open_, close = grammar.marker(OPEN, token_id), grammar.marker(CLOSE, token_id)
        return grammar.lark(
            'start: call ("\\n" call)*' if parallel else "start: call",
            f'call: {open_} "\\n" {call} "\\n" {close}',
        )

    @classmethod
    def auto_constraint(cls, functions: list[FunctionSpec], token_id: TokenId) -> Constraint:
        close = grammar.marker(CLOSE, token_id)
        return grammar.free_text_with_calls(
            functions,
            grammar.marker(OPEN, token_id),
            lambda fn, args: f'{grammar.lark_string(chr(10) + call_head(fn.name))} {args} "}}\\n" {close}',
        )


def call_head(name: str) -> str:
    return f'{{"name": "{name}", "arguments": '
