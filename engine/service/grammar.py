"""A request's grammar matcher, built before it enters the scheduler (every node role's Generate)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from common.sampling import Constraint
from engine.core import Req
from engine.grammar.base import CompiledGrammar
from engine.grammar.compiler import await_matcher


class GrammarSource(Protocol):
    """The engine, or the PD facade over it."""

    def compile_grammar(self, constraint: Constraint) -> Future[CompiledGrammar]: ...


async def attach_grammar(source: GrammarSource, req: Req) -> None:
    """Compile (or fetch from the cache) the request's constraint on the grammar worker while this
    server's event loop goes on, and give the request a fresh matcher. A bad or unsupported grammar
    raises InvalidRequest naming the problem: the servicer answers INVALID_ARGUMENT (the router's
    400) and nothing else on the node notices."""
    c = req.params.constraint
    if c is not None:
        req.grammar = await await_matcher(source.compile_grammar(c))
