"""--stream-interval auto: tokens per message from the node's streamed token rate against its budget."""

from __future__ import annotations

import asyncio

import pytest

from engine.core import FinishReason, Req, SamplingParams
from engine.scheduler import RequestUpdate
from engine.service.stream import RequestStream, parse_stream_interval, set_stream_interval, stream_pacer
from common.stream_pacer import MOST_TOKENS, StreamPacer
from engine.service.stream_pacer import PacerCollector


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_auto_sends_a_token_a_message_under_the_budget_and_groups_above_it() -> None:
    clock = Clock()
    pacer = StreamPacer(messages_per_s=1000, window_s=0.5, clock=clock)
    for tokens_per_s, want in ((800, 1), (2500, 3), (4000, 4), (100_000, MOST_TOKENS), (900, 1)):
        for _ in range(8):  # a window of 0.5 s in eight deliveries (binary-exact times)
            clock.now += 0.0625
            pacer.observe(tokens_per_s // 16)
        assert pacer.interval == want, tokens_per_s
        assert pacer.tokens_per_s == pytest.approx(tokens_per_s, rel=0.05)
    fixed = StreamPacer(fixed=4, messages_per_s=1000, clock=clock)
    clock.now += 1.0
    fixed.observe(100_000)
    assert fixed.interval == 4 and fixed.tokens_per_s > 0  # a fixed interval still reports the rate


def test_the_setting_parses_auto_or_a_count_and_refuses_the_rest() -> None:
    assert parse_stream_interval("auto") is None and parse_stream_interval(" AUTO ") is None
    assert parse_stream_interval("4") == 4 and parse_stream_interval(2) == 2
    for bad in ("0", "-1", "fast", "1.5"):
        with pytest.raises(ValueError, match="--stream-interval"):
            parse_stream_interval(bad)
    with pytest.raises(ValueError, match="--stream-messages-per-s"):
        StreamPacer(messages_per_s=0)
    try:
        pacer = set_stream_interval("auto", 250.0)
        assert stream_pacer() is pacer and pacer.fixed is None and pacer.messages_per_s == 250.0
        metrics = {m.name: m.samples[0].value for m in PacerCollector(stream_pacer, "decode").collect()}
        assert metrics == {"pdserve_node_stream_interval_tokens": 1, "pdserve_node_streamed_tokens_per_second": 0.0}
    finally:
        set_stream_interval(1)


def test_a_stream_groups_as_its_pacer_says_when_the_rate_rises() -> None:
    """A stream reads the pacer at every message: a token a message while under the budget, then
    groups of the pacer's interval once the node's rate passes it."""
    clock = Clock()

    async def run() -> list[list[int]]:
        req = Req(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=20))
        stream = RequestStream(_NoAbort(), req, True, None, frozenset())
        stream.pacer = StreamPacer(messages_per_s=10, window_s=0.5, clock=clock)
        chunks: list[list[int]] = []

        async def consume() -> None:
            async for resp in stream.responses():
                if resp.HasField("chunk"):
                    chunks.append(list(resp.chunk.token_ids))

        reader = asyncio.create_task(consume())
        for tok in range(5, 17):
            clock.now += 0.01 if tok < 10 else 0.1  # 100 tokens/s at first: over a budget of 10 messages/s
            stream.deliver(RequestUpdate("r", [tok], prompt_tokens=3))
            await asyncio.sleep(0.001)
        stream.deliver(RequestUpdate("r", [17], True, FinishReason.LENGTH, prompt_tokens=3))
        await asyncio.wait_for(reader, 5)
        return chunks

    chunks = asyncio.run(run())
    assert chunks[:4] == [[5], [6], [7], [8]]  # the first window not yet over: a token a message
    assert max(len(c) for c in chunks) > 1 and sum(chunks, []) == list(range(5, 18))


class _NoAbort:
    def abort(self, rid: str, reason: str = "aborted") -> None:
        raise AssertionError("nothing aborts here")
