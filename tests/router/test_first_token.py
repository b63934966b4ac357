"""The first token from the prefill's answer (fake nodes): it reaches the client before the decode
sends anything, exactly once, in order with the decode's tokens, through the dispatcher and the
HTTP API (streamed or not); with logprobs asked for the decode's copy is used; a decode failure
after it ends the job with an error, no retry, both legs aborted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from common.tokenizer import Tokenizer
from router.app import RouterApp
from router.contract import DispatchError, FinishEvent, TokenEvent
from router.dispatch import PDDispatcher, StageTimeouts
from tests.router.fake_nodes import Behaviour, FakeNode, cluster, dispatcher, job, run, until

DONE = FinishEvent("length", 4, 3, None, True)  # the fake decode's three tokens for a 4-token prompt


def _source(metrics: CollectorRegistry, source: str) -> float:
    return metrics.get_sample_value("pdserve_router_first_token_source_total", {"source": source}) or 0.0


async def _next(gen: Any, timeout: float = 5.0) -> Any:
    return await asyncio.wait_for(gen.__anext__(), timeout)


@pytest.mark.parametrize("chunks", [True, False])
def test_the_prefill_token_reaches_the_client_while_the_decode_is_held(chunks: bool) -> None:
    async def main() -> None:
        hold = asyncio.Event()
        p, d = FakeNode("prefill"), FakeNode("decode", Behaviour(hold_first=hold, chunks=chunks))
        async with cluster(p, d) as reg:
            metrics = CollectorRegistry()
            gen = dispatcher(reg, metrics_registry=metrics).generate(job("early"))
            assert await _next(gen) == TokenEvent((11,))
            assert not hold.is_set() and len(d.requests) == 1  # the decode has sent nothing yet
            hold.set()
            rest = [e async for e in gen]
            # its first chunk (or its GenerateComplete's first id) repeats 11: skipped
            want = [TokenEvent((12,)), TokenEvent((13,))] if chunks else [TokenEvent((12, 13))]
            assert rest == [*want, DONE]
            assert _source(metrics, "prefill") == 1 and _source(metrics, "decode") == 0
            stage = {
                s: metrics.get_sample_value("pdserve_router_ttft_stage_seconds_count", {"stage": s})
                for s in ("queue", "prefill", "first_decode")
            }
            assert stage == {"queue": 1, "prefill": 1, "first_decode": 1}
            assert not p.aborts and not d.aborts
            await until(lambda: reg.get(p.address).inflight == 0 == reg.get(d.address).inflight)

    run(main())


def test_a_decode_that_speaks_first_wins_and_the_prefill_token_is_not_sent_again() -> None:
    async def main() -> None:
        held = asyncio.Event()
        p, d = FakeNode("prefill", Behaviour(hold_first=held)), FakeNode("decode")
        async with cluster(p, d) as reg:
            metrics = CollectorRegistry()
            gen = dispatcher(reg, metrics_registry=metrics).generate(job())
            assert await _next(gen) == TokenEvent((11,))  # from the decode: the prefill is held
            held.set()
            await until(lambda: reg.get(p.address).inflight == 0)  # its answer is in
            assert [e async for e in gen] == [TokenEvent((12,)), TokenEvent((13,)), DONE]
            assert _source(metrics, "decode") == 1 and _source(metrics, "prefill") == 0

    run(main())


def test_with_logprobs_the_first_token_comes_from_the_decode() -> None:
    async def main() -> None:
        hold = asyncio.Event()
        p, d = FakeNode("prefill"), FakeNode("decode", Behaviour(hold_first=hold))
        async with cluster(p, d) as reg:
            metrics = CollectorRegistry()
            gen = dispatcher(reg, metrics_registry=metrics).generate(job(logprobs=True, top_logprobs=1))
            first = asyncio.ensure_future(gen.__anext__())
            await until(lambda: bool(p.requests) and reg.get(p.address).inflight == 0)  # the prefill answered
            await asyncio.sleep(0.2)
            assert not first.done()  # its token (no logprobs) is not sent: the decode's copy is
            hold.set()
            events = [await asyncio.wait_for(first, 5), *[e async for e in gen]]
            assert [e.token_ids for e in events[:-1]] == [(11,), (12,), (13,)] and events[-1] == DONE
            assert all(e.logprobs == (-0.5,) for e in events[:-1])
            assert _source(metrics, "decode") == 1 and _source(metrics, "prefill") == 0

    run(main())


def test_a_decode_failing_after_the_early_token_ends_the_job_and_aborts_both_legs() -> None:
    async def main() -> None:
        hold = asyncio.Event()
        p = FakeNode("prefill")
        flaky = FakeNode("decode", Behaviour(hold_first=hold, fail_after=0))  # fails once released
        spare = FakeNode("decode", Behaviour(running=5))  # least-load tries the flaky one first
        async with cluster(p, flaky, spare) as reg:
            metrics = CollectorRegistry()
            gen = dispatcher(reg, metrics_registry=metrics).generate(job("late"))
            assert await _next(gen) == TokenEvent((11,))
            hold.set()
            with pytest.raises(DispatchError) as e:
                await _next(gen)
            assert (e.value.status, e.value.code, e.value.before_first_token) == (502, "decode_failed", False)
            assert (
                not spare.requests
                and metrics.get_sample_value("pdserve_router_retries_total", {"reason": "decode_failed"}) is None
            )
            await until(lambda: "late" in p.aborts and "late" in flaky.aborts)
            for node in (p, flaky):
                await until(lambda: reg.get(node.address).inflight == 0)
            assert reg.get(flaky.address).breaker.failures == 1 and reg.get(p.address).breaker.failures == 0

    run(main())


def test_a_decode_silent_after_the_early_token_times_out_within_the_first_token_budget() -> None:
    async def main() -> None:
        hold = asyncio.Event()  # never set: the decode adopts nothing
        p, d = FakeNode("prefill"), FakeNode("decode", Behaviour(hold_first=hold))
        async with cluster(p, d) as reg:
            quick = StageTimeouts(
                prefill_timeout=5, first_token_timeout=0.5, inter_token_timeout=5, abort_timeout=1, health_timeout=0.5
            )
            gen = dispatcher(reg, timeouts=quick).generate(job("slow"))
            assert await _next(gen) == TokenEvent((11,))
            with pytest.raises(DispatchError) as e:
                await _next(gen)  # due 0.5 s after the request, not 0.5 s after the prefill's token
            assert (e.value.status, e.value.code, e.value.before_first_token) == (504, "decode_timeout", False)
            await until(lambda: "slow" in d.aborts and "slow" in d.cancelled and "slow" in p.aborts)
            assert reg.get(d.address).breaker.failures == 1 and reg.get(p.address).breaker.failures == 0

    run(main())


# --- through the HTTP API ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


async def _post(app: Any, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=10) as client:
        return await client.post("/v1/completions", json=body)


def _text(r: httpx.Response, stream: bool) -> tuple[str, dict[str, int]]:
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        return body["choices"][0]["text"], body["usage"]
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_http_text_and_usage_with_the_early_token(tok: Tokenizer, stream: bool) -> None:
    async def main() -> None:
        hold = asyncio.Event()
        p, d = FakeNode("prefill"), FakeNode("decode", Behaviour(hold_first=hold))
        async with cluster(p, d) as reg:
            metrics = CollectorRegistry()
            disp: PDDispatcher = dispatcher(reg, metrics_registry=metrics)
            app = RouterApp(disp, tok, served_model="fake-model", metrics_registry=metrics).app
            body = {
                "model": "fake-model",
                "prompt": [5, 6, 7, 8],
                "max_tokens": 3,
                "temperature": 0,
                "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            }
            post = asyncio.ensure_future(_post(app, body))
            await until(lambda: _source(metrics, "prefill") == 1)  # the early token is out, the decode held
            hold.set()
            text, usage = _text(await asyncio.wait_for(post, 10), stream)
            assert text == tok.decode([11, 12, 13])
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4, 3)

    run(main())
