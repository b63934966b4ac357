"""A node's Generate waits for its grammar off the event loop: a slow compile lets the loop run on,
a bad grammar raises InvalidRequest for that request alone, and a second request hits the cache."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from common.sampling import Constraint, InvalidRequest
from engine.core import Req, SamplingParams
from engine.grammar.compiler import GrammarCompiler
from engine.service.grammar import attach_grammar

GOOD, BAD = Constraint("regex", "a+"), Constraint("regex", "((")


class _Slow:
    """A backend whose compile takes a while (and refuses BAD)."""

    name = "slow"

    def compile(self, kind: str, spec: str):
        time.sleep(0.3)
        if spec == BAD.spec:
            raise InvalidRequest(f"{kind} constraint: unclosed group")
        return SimpleNamespace(matcher=lambda: SimpleNamespace(spec=spec))


def test_compile_waits_off_the_event_loop():
    compiler = GrammarCompiler(_Slow)
    source = SimpleNamespace(compile_grammar=compiler.submit)

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        req = Req("r", [1], SamplingParams(constraint=GOOD))
        await attach_grammar(source, req)
        assert req.grammar is not None and req.grammar.spec == GOOD.spec
        with pytest.raises(InvalidRequest, match="unclosed"):
            await attach_grammar(source, Req("bad", [1], SamplingParams(constraint=BAD)))
        seen = ticks
        again = Req("r2", [1], SamplingParams(constraint=GOOD))
        started = time.perf_counter()
        await attach_grammar(source, again)  # from the cache
        assert time.perf_counter() - started < 0.1 and again.grammar is not req.grammar
        ticker.cancel()
        return seen

    assert asyncio.run(main()) >= 20  # the loop kept running through both 0.3 s compiles
    assert compiler.compiles == 2
    compiler.close()


def test_unconstrained_requests_skip_the_compiler():
    source = SimpleNamespace(compile_grammar=lambda c: pytest.fail("compiled"))
    req = Req("r", [1], SamplingParams())
    asyncio.run(attach_grammar(source, req))
    assert req.grammar is None
