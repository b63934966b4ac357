"""The router's stream pacing: past its message budget it asks each new request's decode for more
tokens a message (sampling_params.stream_interval); under it, or off, it leaves pacing to the nodes."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from common.stream_pacer import StreamPacer
from router.attempt import AttemptContext
from router.contract import TokenEvent
from tests.router.fake_nodes import FakeNode, cluster, collect, dispatcher, job, run
from tests.service.test_stream_pacer import Clock


def test_the_context_asks_for_more_tokens_a_message_only_past_the_budget() -> None:
    clock = Clock()
    ctx = AttemptContext(None, None, lambda f: None, StreamPacer(messages_per_s=100, clock=clock))  # type: ignore[arg-type]
    assert ctx.stream_interval() == 0  # nothing measured: the node's own setting
    for _ in range(10):
        ctx.relayed(TokenEvent((1, 2, 3, 4, 5)))  # 50 tokens ...
    clock.now = 0.5
    ctx.relayed(TokenEvent((1,)))  # ... in half a second: 102 tokens/s against 100 messages/s
    assert ctx.stream_interval() == 2
    clock.now = 1.0
    ctx.relayed(TokenEvent((1,)))  # a quiet window: back to the nodes
    assert ctx.stream_interval() == 0
    for _ in range(60):
        ctx.relayed(TokenEvent((1, 2, 3, 4, 5)))
    clock.now = 1.5
    ctx.relayed(TokenEvent((1,)))
    assert ctx.stream_interval() == 7  # 301 tokens in half a second
    clock.now = 5.0  # then nothing relayed for seconds: new requests are not held to the old rate
    assert ctx.stream_interval() == 0
    assert AttemptContext(None, None, lambda f: None).stream_interval() == 0  # type: ignore[arg-type]


def test_a_dispatcher_past_its_budget_sends_the_interval_and_exports_it() -> None:
    async def main() -> tuple[list[int], list[int], bytes]:
        p, d = FakeNode("prefill"), FakeNode("decode")
        async with cluster(p, d) as reg:
            paced = dispatcher(reg, stream_messages_per_s=1.0)
            await collect(paced, job("a"))
            await asyncio.sleep(0.55)  # the pacer's window has run its length: its rate counts now
            await collect(paced, job("b"))
            await collect(paced, job("c"))
            exported = generate_latest(paced.metrics_registry)
            asked = [r.sampling_params.stream_interval for r in d.requests]
            await paced.close()
            unpaced = dispatcher(reg)
            await collect(unpaced, job("d"))
            await unpaced.close()
            return asked, [r.sampling_params.stream_interval for r in d.requests[3:]], exported

    asked, unpaced, exported = run(main())
    # nothing measured for the first; then a few tokens a second against one message a second
    assert asked[0] == 0 and asked[1] > 1 and asked[2] > 1
    assert unpaced == [0]
    assert b"pdserve_router_stream_interval_tokens" in exported
    assert b"pdserve_router_relayed_tokens_per_second" in exported
