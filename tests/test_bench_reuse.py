"""`pdserve bench`'s prefix-reuse workloads: generation from a seed, the cached/reusable accounting,
and whole runs against an in-process fake OpenAI server with a word-level, page-granular prefix cache."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI  # module level: FastAPI resolves the string annotations here

from fixtures.fake_openai import add_generation_routes, serving, sse
from typer.testing import CliRunner

from loadgen.client import EndpointConfig
from loadgen.metrics import RequestRecord
from loadgen.reuse import cache_accounting, mark_shared_prefix, multi_turn_reusable
from loadgen.reuse_points import converse
from loadgen.runner import BenchOptions, run_bench
from loadgen.sweep import format_summary
from loadgen.workloads import TURN_SEPARATOR, Conversation, conversations, shared_prefix_requests, turn_request

CORPUS = " ".join(f"w{i}" for i in range(5000))  # distinct words: no accidental shared prefixes
PAGE = 4  # the fake cache reuses whole pages of 4 words, as a paged KV cache does
THINK_S = 0.05


# ---- generation --------------------------------------------------------------------------------


def test_conversations_are_seeded_and_turns_carry_the_history() -> None:
    def make(seed: int, point: int = 0) -> list[Conversation]:
        return conversations(3, 4, 12, 5, 6, think_time_s=THINK_S, seed=seed, point=point, corpus=CORPUS)

    convs = make(7)
    assert convs == make(7) and convs != make(8) and convs != make(7, point=1)
    for c in convs:
        assert c.turns == 4 and c.input_lens == (12, 5, 5, 5) and c.output_lens == (6,) * 4
        assert c.think_s[0] == 0 and all(t > 0 for t in c.think_s[1:])
    # Exponential with the asked mean (many samples, generous bound).
    many = conversations(400, 3, 1, 1, 1, think_time_s=0.2, seed=1, corpus=CORPUS)
    thinks = [t for c in many for t in c.think_s[1:]]
    assert sum(thinks) / len(thinks) == pytest.approx(0.2, rel=0.15)

    conv, replies = convs[0], ["first reply", "second reply"]
    chat = turn_request(conv, 2, replies, [2, 2], "chat")
    assert [m["role"] for m in chat.messages or ()] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in chat.messages or ()][1::2] == replies
    assert chat.index == 2 and chat.input_len == 12 + 5 + 5 + 4 and chat.keep_reply
    text = turn_request(conv, 2, replies, [2, 2], "completions").prompt
    prev = turn_request(conv, 1, replies[:1], [2], "completions").prompt
    assert isinstance(text, str) and isinstance(prev, str)
    assert text.startswith(prev + replies[1] + TURN_SEPARATOR)  # each prompt extends the last one verbatim
    with pytest.raises(ValueError, match="earlier replies"):
        turn_request(conv, 2, replies[:1], [2], "chat")


def test_shared_prefix_requests() -> None:
    work = shared_prefix_requests(20, 3, 8, 4, 5, "chat", seed=2, corpus=CORPUS)
    assert work == shared_prefix_requests(20, 3, 8, 4, 5, "chat", seed=2, corpus=CORPUS)
    assert len(set(work.prefix_of)) == 3 and len(set(work.prefixes)) == 3
    users = set()
    for req, p in zip(work.requests, work.prefix_of):
        system, user = req.messages or ()
        assert system == {"role": "system", "content": work.prefixes[p]} and user["role"] == "user"
        assert len(work.prefixes[p]) == 8 * 4 and req.input_len == 8 + 4  # ~4 characters per token
        users.add(user["content"])
    assert len(users) == 20  # the part after the prefix is each request's own
    plain = shared_prefix_requests(4, 2, 8, 4, 5, "completions", seed=2, corpus=CORPUS)
    assert all(
        str(r.prompt).startswith(plain.prefixes[p] + TURN_SEPARATOR) for r, p in zip(plain.requests, plain.prefix_of)
    )


# ---- accounting --------------------------------------------------------------------------------


def _ok(prompt: int, out: int, cached: int | None, reusable: int | None = None) -> RequestRecord:
    return RequestRecord(
        0,
        0,
        0,
        ttft=0.1,
        e2e=0.2,
        output_tokens=out,
        prompt_tokens=prompt,
        cached_tokens=cached,
        reusable_tokens=reusable,
    )


def test_reusable_and_cached_accounting() -> None:
    t1, t2 = _ok(100, 20, 0), _ok(150, 20, 112)
    assert multi_turn_reusable(None, t1) == 0 and multi_turn_reusable(t1, t2) == 120
    assert multi_turn_reusable(t1, _ok(110, 5, None)) == 110  # capped by this turn's prompt
    assert multi_turn_reusable(_ok(100, 20, 0), replace(t2, prompt_tokens=None)) is None  # no usage: unknown
    recs = [_ok(100, 20, 0, 0), _ok(150, 20, 112, 120), _ok(200, 20, 160, 170), RequestRecord(0, 0, 0, error="x")]
    acc = cache_accounting(recs)
    assert acc == {
        "prompt_tokens": 450,
        "cached_tokens": 272,
        "reusable_tokens": 290,
        "reuse_ratio": pytest.approx(272 / 290),
        "requests_reporting_cached": 3,
    }
    unreported = cache_accounting([_ok(100, 20, None, 0), _ok(150, 20, None, 120)])
    assert unreported["cached_tokens"] is None and unreported["reuse_ratio"] is None  # null, not 0
    assert unreported["reusable_tokens"] == 120
    assert cache_accounting([_ok(10, 1, 0, 0)])["reuse_ratio"] is None  # nothing reusable: no ratio
    shared = [_ok(30, 1, 0), _ok(30, 1, 16), _ok(12, 1, 8), _ok(30, 1, 0)]
    mark_shared_prefix(shared, [1, 1, 1, 0], prefix_len=16)
    assert [(r.prefix, r.reusable_tokens) for r in shared] == [(1, 0), (1, 16), (1, 12), (0, 0)]


# ---- the fake server ---------------------------------------------------------------------------


class FakeState:
    """What the fake saw and remembers: every (body, reply) and the token runs its cache holds."""

    def __init__(self) -> None:
        self.exchanges: list[tuple[dict[str, Any], str]] = []
        self.cache: list[list[str]] = []

    def reset(self) -> None:
        self.exchanges.clear()
        self.cache.clear()


def _tokens(body: dict[str, Any]) -> list[str]:
    """One token per whitespace-separated word of the prompt or of the messages in order."""
    if "messages" in body:
        return [w for m in body["messages"] for w in m["content"].split()]
    return str(body["prompt"]).split()


def _cached(state: FakeState, tokens: list[str]) -> int:
    best = 0
    for run in state.cache:
        n = 0
        while n < min(len(run), len(tokens)) and run[n] == tokens[n]:
            n += 1
        best = max(best, n)
    return min(best, len(tokens) - 1) // PAGE * PAGE  # whole pages, and never the last prompt token


def _fake_app(state: FakeState) -> Any:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        tokens, n = _tokens(body), int(body["max_tokens"])
        cached = _cached(state, tokens)
        tag = hashlib.sha1(json.dumps(body.get("messages") or body.get("prompt")).encode()).hexdigest()[:6]
        words = [f"{tag}{i}" for i in range(n)]  # a reply of its own per prompt
        for word in words:
            await asyncio.sleep(0.002)
            piece = " " + word  # the leading space keeps a transcript's words apart
            choice = {"delta": {"content": piece}} if chat else {"text": piece}
            yield sse({"choices": [{"index": 0, **choice}]})
        state.exchanges.append((body, "".join(" " + w for w in words)))
        state.cache.append(tokens + words)
        usage: dict[str, Any] = {"prompt_tokens": len(tokens), "completion_tokens": n}
        if not body.get("fake_no_cached_tokens"):
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    add_generation_routes(app, stream)
    return app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    with serving(_fake_app(state)) as url:
        yield url, state


def _opts(url: str, tmp_path: Path, **kw: Any) -> BenchOptions:
    base: dict[str, Any] = dict(base_url=url, out=tmp_path, plots=False, progress=False, range_ratio=0.0)
    return BenchOptions(**{**base, **kw})


# ---- whole runs --------------------------------------------------------------------------------


def test_multi_turn_chat_run(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    state.reset()
    opts = _opts(
        url,
        tmp_path,
        endpoint="chat",
        workload="multi-turn",
        num_prompts=3,
        turns=4,
        input_len=10,
        turn_input_len=6,
        output_len=5,
        think_time=THINK_S,
        request_rate="20,inf",
        seed=3,
    )
    report, files = run_bench(opts, progress=False)
    assert json.loads(files[0].read_text()) == report
    assert report["config"]["dataset"]["turns"] == 4 and report["config"]["dataset"]["conversations"] == 3

    # Every assistant message is, verbatim, what the server answered to the history before it.
    answered = {json.dumps(body["messages"]): reply for body, reply in state.exchanges}
    assert len(state.exchanges) == 2 * 3 * 4
    for body, _ in state.exchanges:
        msgs = body["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2) + ["user"]
        for j in range(1, len(msgs), 2):
            assert msgs[j]["content"] == answered[json.dumps(msgs[:j])]

    for point_index, point in enumerate(report["points"]):
        recs, m = point["requests"], point["metrics"]
        assert m["completed"] == 12 and m["failed"] == 0
        plan = conversations(3, 4, 10, 6, 5, think_time_s=THINK_S, seed=3, point=point_index)
        for conv in plan:  # turns in order, each after the last reply plus its think time
            turns = sorted((r for r in recs if r["conversation"] == conv.id), key=lambda r: r["turn"])
            assert [r["turn"] for r in turns] == [1, 2, 3, 4]
            for prev, cur in zip(turns, turns[1:]):
                gap = cur["start"] - (prev["start"] + prev["e2e"])
                assert conv.think_s[cur["turn"] - 1] - 0.005 <= gap <= conv.think_s[cur["turn"] - 1] + 0.5
        # Per-turn percentiles, and the accounting as specified.
        assert list(m["by_turn"]) == ["1", "2", "3", "4", "3+"] and m["by_turn"]["3+"]["requests"] == 6
        for label, g in m["by_turn"].items():
            assert all(g[k]["median"] is not None and g[k]["p99"] is not None for k in ("ttft_ms", "tpot_ms")), label
        by_conv = {(r["conversation"], r["turn"]): r for r in recs}
        for r in recs:
            prev = by_conv.get((r["conversation"], r["turn"] - 1))
            want = 0 if prev is None else min(prev["prompt_tokens"] + prev["output_tokens"], r["prompt_tokens"])
            assert r["reusable_tokens"] == want and r["cached_tokens"] == want // PAGE * PAGE
        first = m["by_turn"]["1"]
        assert first["cached_tokens"] == 0 and first["reusable_tokens"] == 0 and first["reuse_ratio"] is None
        for label in ("2", "3+"):
            g = m["by_turn"][label]
            mine = [r for r in recs if (r["turn"] >= 3 if label == "3+" else r["turn"] == 2)]
            assert g["cached_tokens"] == sum(r["cached_tokens"] for r in mine)
            assert g["reuse_ratio"] == pytest.approx(g["cached_tokens"] / g["reusable_tokens"])
        total = m["prefix_cache"]
        assert total["reuse_ratio"] == pytest.approx(
            sum(r["cached_tokens"] for r in recs) / sum(r["reusable_tokens"] for r in recs)
        )
        assert 0.7 < total["reuse_ratio"] <= 1.0 and total["requests_reporting_cached"] == 12
    assert "turn 3+" in format_summary(report) and "reusable" in format_summary(report)


def test_multi_turn_is_reproducible_and_reports_null_without_cached_tokens(
    fake: tuple[str, FakeState], tmp_path: Path
) -> None:
    url, state = fake
    runs = []
    for seed in (5, 5, 6):
        state.reset()
        opts = _opts(
            url,
            tmp_path,
            workload="multi-turn",
            num_prompts=2,
            turns=3,
            input_len=8,
            turn_input_len=4,
            output_len=4,
            concurrency="1",
            seed=seed,
            extra_body={"fake_no_cached_tokens": True},
        )
        report, _ = run_bench(opts, progress=False)
        runs.append((list(state.exchanges), report["points"][0]))
    (seen_a, point_a), (seen_b, point_b), (seen_c, _) = runs
    assert seen_a == seen_b and seen_a != seen_c  # the seed decides every prompt (and so every reply)
    timing = ("start", "ttft", "chunk_times", "e2e", "tpot")  # the only things a rerun may change
    untimed = [[{k: v for k, v in r.items() if k not in timing} for r in p["requests"]] for p in (point_a, point_b)]
    assert untimed[0] == untimed[1]
    # Completions endpoint, one conversation at a time: a turn's prompt is the previous prompt, the
    # server's reply to it, a blank line and the new message.
    for i in range(1, len(seen_a)):
        if i % 3:
            (prev, reply), (cur, _) = seen_a[i - 1], seen_a[i]
            assert cur["prompt"].startswith(prev["prompt"] + reply + TURN_SEPARATOR)
    m = point_a["metrics"]
    assert all(r["cached_tokens"] is None for r in point_a["requests"])  # not reported: null, not 0
    assert m["prefix_cache"]["cached_tokens"] is None and m["prefix_cache"]["reuse_ratio"] is None
    assert m["by_turn"]["2"]["cached_tokens"] is None and m["by_turn"]["2"]["reusable_tokens"] > 0


def test_shared_prefix_run(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, state = fake
    state.reset()
    opts = _opts(
        url,
        tmp_path,
        workload="shared-prefix",
        num_prompts=8,
        num_prefixes=2,
        prefix_len=12,
        input_len=6,
        output_len=3,
        concurrency="1",
        seed=1,
    )
    report, _ = run_bench(opts, progress=False)
    (point,) = report["points"]
    recs, m = point["requests"], point["metrics"]
    work = shared_prefix_requests(8, 2, 12, 6, 3, "completions", seed=1)
    assert [b["prompt"] for b, _ in state.exchanges] == [r.prompt for r in work.requests]  # one at a time, in order
    seen: set[int] = set()
    for r, p in zip(recs, work.prefix_of):
        assert r["prefix"] == p
        assert r["reusable_tokens"] == (min(12, r["prompt_tokens"]) if p in seen else 0)
        seen.add(p)
    assert set(m["by_prefix_use"]) == {"first", "repeat"} and m["by_prefix_use"]["first"]["requests"] == 2
    repeat = m["by_prefix_use"]["repeat"]
    assert repeat["cached_tokens"] == sum(r["cached_tokens"] for r in recs if r["reusable_tokens"]) > 0
    assert repeat["reuse_ratio"] == pytest.approx(repeat["cached_tokens"] / repeat["reusable_tokens"])
    assert m["by_prefix_use"]["first"]["cached_tokens"] == 0


def test_a_failed_turn_ends_its_conversation(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    conv = Conversation(4, ("a b", "c d", "e f"), (2, 2, 2), (3, 13, 3), (0.0, 0.0, 0.0))  # 13: the fake's 503

    async def go() -> list[RequestRecord]:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            return await converse(client, EndpointConfig(url, "m", endpoint="chat"), conv, time.perf_counter())

    recs = asyncio.run(go())
    assert [(r.conversation, r.turn, r.index) for r in recs] == [(4, 1, 12), (4, 2, 13), (4, 3, 14)]
    assert recs[0].ok and recs[1].error and recs[1].error.startswith("HTTP 503")
    assert recs[2].error == "not sent: turn 2 of its conversation failed"


def test_random_records_keep_their_shape(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, _ = fake
    report, _ = run_bench(_opts(url, tmp_path, num_prompts=2, input_len=4, output_len=3), progress=False)
    rec = report["points"][0]["requests"][0]
    assert not {"conversation", "turn", "prefix", "reusable_tokens", "reply"} & set(rec) and rec["cached_tokens"] == 0
    assert "by_turn" not in report["points"][0]["metrics"] and report["config"]["dataset"]["name"].startswith("random")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workload", "multi-turn", "--turns", "0"], "--turns must be at least 1"),
        (["--workload", "multi-turn", "--turn-input-len", "0"], "--turn-input-len must be at least 1"),
        (["--workload", "multi-turn", "--think-time", "-1"], "--think-time must be >= 0"),
        (["--workload", "shared-prefix", "--num-prefixes", "0"], "--num-prefixes must be at least 1"),
        (["--turns", "3"], "--turns applies to --workload multi-turn only"),
        (["--workload", "multi-turn", "--prefix-len", "8"], "--prefix-len applies to --workload shared-prefix only"),
        (["--workload", "shared-prefix", "--think-time", "1"], "--think-time applies to --workload multi-turn only"),
        (["--workload", "chat"], "--workload must be one of random, multi-turn, shared-prefix"),
    ],
)
def test_bad_flag_combinations_are_clear_errors(flags: list[str], message: str) -> None:
    from pdserve.cli import app

    res = CliRunner().invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", *flags, "--no-progress"])
    assert res.exit_code == 2 and message in res.output, res.output
