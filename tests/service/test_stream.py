"""A request's response stream: updates queued behind one another go out as one message, a stop
string inside them still ends the stream where it completes, and a step's updates wake the loop once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.core import FinishReason, Req, SamplingParams
from engine.scheduler import RequestUpdate
from engine.service.stream import RequestStream
from common.stream_pacer import StreamPacer


class Letters:
    """A tokenizer stand-in: id i decodes to the i-th lowercase letter."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class Aborts:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def abort(self, rid: str, reason: str = "aborted") -> None:
        self.calls.append((rid, reason))


def _req(stop: tuple[str, ...] = (), stream_interval: int = 0) -> Req:
    params = SamplingParams(max_new_tokens=16, stop=stop, stream_interval=stream_interval)
    return Req(rid="r", prompt_ids=[0, 1, 2], params=params)


async def _drain(stream: RequestStream) -> list:
    return [resp async for resp in stream.responses()]


def test_updates_queued_behind_one_another_go_out_as_one_message() -> None:
    async def run() -> list:
        stream = RequestStream(Aborts(), _req(), True, None, frozenset())
        for i, tok in enumerate((5, 6, 7)):
            stream.deliver(RequestUpdate("r", [tok], logprobs=[-0.1 * (i + 1)], prompt_tokens=3))
        stream.deliver(RequestUpdate("r", [], True, FinishReason.LENGTH, prompt_tokens=3))
        return await _drain(stream)

    chunk, complete = asyncio.run(run())
    assert list(chunk.chunk.token_ids) == [5, 6, 7]
    assert chunk.chunk.completion_tokens == 3
    assert [round(v, 3) for v in chunk.chunk.output_logprobs.token_logprobs] == [-0.1, -0.2, -0.3]
    assert list(complete.complete.output_ids) == [5, 6, 7]
    assert complete.complete.finish_reason == "length"


def test_updates_that_arrive_one_at_a_time_go_out_one_at_a_time() -> None:
    async def run() -> list[list[int]]:
        stream = RequestStream(Aborts(), _req(), True, None, frozenset())
        out = stream.responses()
        sent = []
        for tok in (5, 6):
            stream.deliver(RequestUpdate("r", [tok], prompt_tokens=3))
            sent.append(list((await anext(out)).chunk.token_ids))
        stream.deliver(RequestUpdate("r", [], True, FinishReason.LENGTH, prompt_tokens=3))
        assert (await anext(out)).HasField("complete")
        return sent

    assert asyncio.run(run()) == [[5], [6]]


def test_a_stream_interval_sends_the_first_token_alone_then_groups_and_the_end_at_once() -> None:
    """--stream-interval 3: the first token at once (TTFT), then messages of at least 3 tokens, and
    what is left when the request ends goes out then; the complete message holds every token. The
    consumer reads every update as it comes (no backlog merges them): the interval alone groups."""

    async def run(interval: int, asked: int = 0) -> tuple[list[list[int]], list[float], list[int]]:
        stream = RequestStream(Aborts(), _req(stream_interval=asked), True, None, frozenset())
        stream.pacer = StreamPacer(fixed=interval)
        chunks: list[list[int]] = []
        logprobs: list[float] = []
        complete: list[int] = []

        async def consume() -> None:
            async for resp in stream.responses():
                if resp.HasField("chunk"):
                    chunks.append(list(resp.chunk.token_ids))
                    logprobs.extend(resp.chunk.output_logprobs.token_logprobs)
                else:
                    complete.extend(resp.complete.output_ids)

        reader = asyncio.create_task(consume())
        for tok in range(5, 12):  # one token a step, as a decode node streams them
            stream.deliver(RequestUpdate("r", [tok], logprobs=[-float(tok)], prompt_tokens=3))
            await asyncio.sleep(0.001)
        stream.deliver(RequestUpdate("r", [12], True, FinishReason.LENGTH, logprobs=[-12.0], prompt_tokens=3))
        await asyncio.wait_for(reader, 5)
        return chunks, logprobs, complete

    chunks, logprobs, complete = asyncio.run(run(3))
    assert chunks == [[5], [6, 7, 8], [9, 10, 11], [12]]
    assert logprobs == [-float(t) for t in range(5, 13)] and complete == list(range(5, 13))
    assert asyncio.run(run(1))[0] == [[t] for t in range(5, 13)]  # the default: a message a token
    # a request's own stream_interval (a pacing router's) counts where it asks for more
    assert asyncio.run(run(1, asked=3))[0] == [[5], [6, 7, 8], [9, 10, 11], [12]]
    assert asyncio.run(run(3, asked=2))[0] == [[5], [6, 7, 8], [9, 10, 11], [12]]


def test_a_request_stream_interval_out_of_range_is_refused_by_name() -> None:
    from common.sampling import InvalidRequest

    for bad in (-1, 100_000):
        with pytest.raises(InvalidRequest, match="stream_interval"):
            SamplingParams(stream_interval=bad)


def test_a_stream_interval_below_one_is_refused() -> None:

    from engine.service.stream import set_stream_interval

    with pytest.raises(ValueError, match="--stream-interval must be >= 1"):
        set_stream_interval(0)


def test_a_stop_string_inside_queued_updates_ends_the_stream_where_it_completes() -> None:
    aborts = Aborts()

    async def run() -> list:
        stream = RequestStream(aborts, _req(stop=("cd",)), True, Letters(), frozenset())
        for tok in (1, 2, 3, 4):  # b, c, d, e: "cd" completes with the third
            stream.deliver(RequestUpdate("r", [tok], prompt_tokens=3))
        return await _drain(stream)

    chunk, complete = asyncio.run(run())
    assert list(chunk.chunk.token_ids) == [1, 2, 3]
    assert list(complete.complete.output_ids) == [1, 2, 3]
    assert complete.complete.finish_reason == "stop"
    assert complete.complete.matched_stop_str == "cd"
    assert aborts.calls == [("r", "stop string")]


def test_a_steps_updates_wake_the_event_loop_once() -> None:
    async def run() -> tuple[int, list[int]]:
        aio = asyncio.get_running_loop()
        wakeups = 0
        original = aio.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal wakeups
            wakeups += 1
            return original(*args, **kwargs)

        aio.call_soon_threadsafe = counting  # type: ignore[method-assign]
        streams = [RequestStream(Aborts(), _req(), True, None, frozenset()) for _ in range(50)]
        step = threading.Thread(target=lambda: [s.on_update(RequestUpdate("r", [9], True)) for s in streams])
        step.start()
        step.join(timeout=10)  # the loop does not run meanwhile: the whole step queues up
        results = await asyncio.wait_for(asyncio.gather(*(_drain(s) for s in streams)), 10)
        del aio.call_soon_threadsafe
        return wakeups, [len(r) for r in results]

    wakeups, messages = asyncio.run(run())
    assert wakeups == 1
    assert messages == [2] * 50  # each stream's token and its end
