"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, with 9-character ids."""

from __future__ import annotations

from common.sampling import Constraint
from router.tools import grammar
from router.tools.base import WS, ToolParser
from router.tools.grammar import TokenId
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
    def required_constraint(cls, functions: list[FunctionSpec], parallel: bool, token_id: TokenId) -> Constraint:
        calls = grammar.lark_json(grammar.array_schema(functions, "arguments", parallel))
        return grammar.lark(f"start: {grammar.marker(TOOL_CALLS, token_id)} {calls}")

    @classmethod
    def auto_constraint(cls, functions: list[FunctionSpec], token_id: TokenId) -> Constraint:
        # one call per [TOOL_CALLS] here: a free-text grammar cannot hold a whole array to the schemas
        return grammar.free_text_with_calls(
            functions,
            grammar.marker(TOOL_CALLS, token_id),
            lambda fn, args: f'{grammar.lark_string(f"""[{{"name": "{fn.name}", "arguments": """)} {args} "}}]"',
        )
