"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole answer (optionally
after `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

from common.sampling import Constraint
from router.tools import grammar
from router.tools.base import WS, ToolParser
from router.tools.grammar import TokenId
from router.tools.schema import FunctionSpec

PYTHON_TAG = "<|python_tag|>"
HEAD = '{"name": '


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    between = (WS, ";", WS)
    template_hints = (PYTHON_TAG, '"parameters": dictionary of argument name')
    keeps_special_tokens = True  # <|python_tag|> is one

    def find_start(self, text: str) -> tuple[int, str] | None:
        # An answer that opens with a JSON object is a call (the template asks for exactly that).
        # Leading whitespace goes with it (it is content again if no call follows).
        stripped = text.lstrip()
        if not self.content.strip() and stripped.startswith("{"):
            return 0, text[: len(text) - len(stripped)]
        return super().find_start(text)

    def hold(self, text: str) -> int:
        if not self.content.strip() and not text.strip():
            return len(text)  # leading whitespace: whether a JSON call follows is not known yet
        return super().hold(text)

    @classmethod
    def required_constraint(cls, functions: list[FunctionSpec], parallel: bool, token_id: TokenId) -> Constraint:
        # One call, in the plain JSON the template asks for (Llama 3 templates take no parallel calls).
        return grammar.json_constraint(grammar.calls_schema(functions, "parameters"))

    @classmethod
    def auto_constraint(cls, functions: list[FunctionSpec], token_id: TokenId) -> Constraint:
        return grammar.free_text_with_calls(
            functions,
            grammar.lark_string(HEAD),
            lambda fn, args: f'{grammar.lark_string(f""""{fn.name}", "parameters": """)} {args} "}}"',
        )
