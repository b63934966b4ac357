"""What a chat request's tools mean for its run: the template's tools, the parser, the constraint.

- `tool_choice` `none` (or no tools): the template gets no tools, nothing is parsed, nothing is
  constrained; the model answers in text, as OpenAI's `none` promises.
- `auto`: the template gets the tools and the output is parsed; it is constrained only when a
  tool says `strict: true` (free text, and calls held to their schemas: router/tools/grammar.py).
- `required` and a named function: the output is constrained to the format's call section (one
  call for a named function or `parallel_tool_calls: false`).
`parallel_tool_calls: false` also keeps only the first call parsed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from common.sampling import Constraint
from router.errors import bad_request
from router.structured import request_constraints, single
from router.tools.base import ToolParser
from router.tools.schema import FunctionSpec, functions, tool_choice


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None = None
    parser: type[ToolParser] | None = None
    constraint: Constraint | None = None
    max_calls: int | None = None

    def parsers(self, n: int) -> list[ToolParser] | None:
        """A fresh parser per choice, or None when the output is plain text."""
        return None if self.parser is None else [self.parser(self.max_calls) for _ in range(n)]

    def skip_special_tokens(self, asked: bool) -> bool:
        """A parser whose markers are special tokens must see them in the text."""
        return asked and not (self.parser is not None and self.parser.keeps_special_tokens)


def plan_tools(req: Any, parser: type[ToolParser] | None, token_id: Callable[[str], int | None]) -> ToolPlan:
    """The plan of a validated ChatCompletionRequest; a 400 for tools it cannot honour."""
    specs = functions(req.tools) if req.tools is not None else []
    choice = tool_choice(req.tool_choice, specs)
    if choice == "none":
        return ToolPlan()
    if parser is None:
        raise bad_request(
            "Tool calling is not available: the model's chat template shows no known tool-call format. "
            "Start the router with --tool-call-parser.",
            param="tools",
            code="unsupported_parameter",
        )
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, FunctionSpec):
        constraint: Constraint | None = parser.required_constraint([choice], False, token_id)
        parallel = False
    elif choice == "required":
        constraint = parser.required_constraint(specs, parallel, token_id)
    else:
        constraint = parser.auto_constraint(specs, token_id) if any(f.strict for f in specs) else None
    return ToolPlan(req.tools, parser, constraint, None if parallel else 1)


def plan_chat(
    req: Any, parser: type[ToolParser] | None, token_id: Callable[[str], int | None]
) -> tuple[ToolPlan, Constraint | None]:
    """The tool plan and the request's one constraint (structured output or tools, never both)."""
    tools = plan_tools(req, parser, token_id)
    found = request_constraints(req)
    if tools.constraint is not None:
        found.append(("tool_choice", tools.constraint))
    return tools, single(found)
