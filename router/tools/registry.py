"""The tool-call parsers by name (`--tool-call-parser`), and which one a chat template asks for."""

from __future__ import annotations

from typing import Sequence

from router.tools.base import ToolParser
from router.tools.hermes import HermesParser
from router.tools.llama3 import Llama3JsonParser
from router.tools.mistral import MistralParser

# Detection order: the first whose hints a template shows wins.
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, MistralParser, Llama3JsonParser)}


def parser_named(name: str) -> type[ToolParser]:
    """The parser called `name`; ValueError listing the known ones otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return PARSERS[name]


def detect(templates: Sequence[str]) -> type[ToolParser] | None:
    """The parser whose format the chat template text shows, if any."""
    for parser in PARSERS.values():
        if any(hint in t for t in templates for hint in parser.template_hints):
            return parser
    return None


def resolve(name: str | None, templates: Sequence[str]) -> type[ToolParser] | None:
    """The `--tool-call-parser` flag's parser, or the template's when the flag is not given."""
    return parser_named(name) if name else detect(templates)
