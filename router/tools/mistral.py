"""Mistral tool calls, in both of its formats, with 9-character ids:
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) and
`[TOOL_CALLS]NAME[ARGS]{...}`, once per call (v11 on: Mistral Small 3.2, Devstral, Magistral).

The parser reads either; the constraints follow the vocabulary: one with an `[ARGS]` token is v11.
"""

from __future__ import annotations

import re

from common.sampling import Constraint
from router.tools import grammar
from router.tools.base import NO, WS, ToolParser, match
from router.tools.grammar import TokenId
from router.tools.jsonscan import ObjectScan, skip_ws
from router.tools.schema import FunctionSpec

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME_ARGS = re.compile(r"\s*([A-Za-z0-9_-]+)\[ARGS\]\s*")
_NAME_ARGS_SO_FAR = re.compile(r"\s*[A-Za-z0-9_-]*(\[(A(R(G(S)?)?)?)?)?")  # may still become _NAME_ARGS


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    first = (WS, "[", WS)
    between = (WS, ",", WS)
    template_hints = (TOOL_CALLS,)
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens
    id_prefix, id_length = "", 9  # Mistral's templates refuse other ids in the history

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._v11: bool | None = None  # which format, once the text after the marker says
        self._name = ""  # v11: the name before the open call's arguments

    def locate(self) -> int | None:
        if self._v11 is None:
            i = skip_ws(self._buf, self._pos)
            if i >= len(self._buf):
                return None
            self._v11 = self._buf[i] != "["
        if not self._v11:
            return super().locate()
        at = match(self._buf, self._pos, (WS, TOOL_CALLS)) if self.calls else self._pos
        if at is None or at == NO:
            return at
        m = _NAME_ARGS.match(self._buf, at)
        if m is None:
            return None if _NAME_ARGS_SO_FAR.fullmatch(self._buf, at) else NO
        if m.end() >= len(self._buf):
            return None
        self._name = m.group(1)
        return m.end() if self._buf[m.end()] == "{" else NO

    def _fields(self, scan: ObjectScan) -> tuple[str | None, str, bool]:
        if not self._v11:
            return super()._fields(scan)
        return self._name, self._buf[self._obj : scan.end], scan.end is not None  # the object is the arguments

    @classmethod
    def required_constraint(cls, functions: list[FunctionSpec], parallel: bool, token_id: TokenId) -> Constraint:
        tc = grammar.marker(TOOL_CALLS, token_id)
        if token_id(ARGS) is None:
            calls = grammar.lark_json(grammar.array_schema(functions, "arguments", parallel))
            return grammar.lark(f"start: {tc} {calls}")
        args = grammar.marker(ARGS, token_id)
        alternatives = " | ".join(
            f"{grammar.lark_string(f.name)} {args} {grammar.lark_json(f.parameters)}" for f in functions
        )
        return grammar.lark("start: call+" if parallel else "start: call", f"call: {tc} ({alternatives})")

    @classmethod
    def auto_constraint(cls, functions: list[FunctionSpec], token_id: TokenId) -> Constraint:
        v11 = token_id(ARGS) is not None
        args = grammar.marker(ARGS, token_id)

        def body(fn: FunctionSpec, schema: str) -> str:
            if v11:
                return f"{grammar.lark_string(fn.name)} {args} {schema}"
            # one call per [TOOL_CALLS]: a free-text grammar cannot hold a whole array to the schemas
            head = grammar.lark_string('[{"name": "' + fn.name + '", "arguments": ')
            return f'{head} {schema} "}}]"'

        return grammar.free_text_with_calls(functions, grammar.marker(TOOL_CALLS, token_id), body)
