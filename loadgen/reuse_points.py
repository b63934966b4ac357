"""Load points of the prefix-reuse workloads: conversations as the unit of arrival, shared prefixes.

Multi-turn: a conversation arrives like one request of the random workload does (Poisson arrival
times from the point's seed, or a slot of the fixed concurrency, held through its think times:
N concurrent users); its turns go one after another, each sent after the previous reply and the
turn's think time. A failed turn ends its conversation: the turns it never sent are recorded as
failed ("not sent: ..."), so every point has conversations x turns records.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from loadgen.client import Clock, EndpointConfig, send
from loadgen.dataset import BenchRequest, TextTokenizer, random_requests
from loadgen.metrics import RequestRecord
from loadgen.reuse import mark_shared_prefix, multi_turn_metrics, multi_turn_reusable, shared_prefix_metrics
from loadgen.sweep import LoadPoint, run_point, under_load
from loadgen.workloads import Conversation, conversations, shared_prefix_requests, turn_request

WARMUP_SEED = 1_000_003  # warm-up prompts from their own seed: they must not prime the measured prefixes


async def run_conversations(
    client: httpx.AsyncClient,
    cfg: EndpointConfig,
    convs: list[Conversation],
    load: LoadPoint,
    *,
    seed: int = 0,
    clock: Clock = time.perf_counter,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Run every conversation under `load` (a conversation is the unit of arrival and holds its
    concurrency slot through its think times); records in (conversation, turn) order, and wall time."""

    async def one(conv: Conversation, t0: float) -> list[RequestRecord]:
        return await converse(client, cfg, conv, t0, clock, on_done)

    per_conv, wall = await under_load(convs, load, one, seed=seed, clock=clock)
    return [rec for recs in per_conv for rec in recs], wall


async def converse(
    client: httpx.AsyncClient,
    cfg: EndpointConfig,
    conv: Conversation,
    t0: float,
    clock: Clock = time.perf_counter,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """One conversation's turns in order; each request carries the replies received so far."""
    records: list[RequestRecord] = []
    replies: list[str] = []
    reply_tokens: list[int] = []
    for turn in range(conv.turns):
        if conv.think_s[turn] > 0:
            await asyncio.sleep(conv.think_s[turn])
        req = turn_request(conv, turn, replies, reply_tokens, cfg.endpoint)
        rec = await send(client, cfg, req, t0, clock)
        rec.conversation, rec.turn = conv.id, turn + 1
        rec.reusable_tokens = multi_turn_reusable(records[-1] if records else None, rec)
        records.append(rec)
        if on_done is not None:
            on_done(rec)
        if not rec.ok:
            for rest in range(turn + 1, conv.turns):
                skipped = RequestRecord(
                    conv.id * conv.turns + rest,
                    conv.input_lens[rest],
                    conv.output_lens[rest],
                    error=f"not sent: turn {turn + 1} of its conversation failed",
                    conversation=conv.id,
                    turn=rest + 1,
                )
                records.append(skipped)
                if on_done is not None:
                    on_done(skipped)
            break
        replies.append(rec.reply or "")
        reply_tokens.append(rec.output_tokens)
    return records


@dataclass
class MultiTurnWorkload:
    """`pdserve bench --workload multi-turn`: fresh conversations (same seed) at every load point."""

    num_conversations: int
    turns: int
    input_len: int
    turn_input_len: int
    output_len: int
    range_ratio: float
    think_time_s: float
    seed: int
    endpoint: str
    tokenizer: TextTokenizer | None = None
    corpus: str | None = None
    plans: dict[int, list[Conversation]] = field(default_factory=dict)  # built once per point, kept to inspect

    def plan(self, point: int) -> list[Conversation]:
        if point not in self.plans:
            self.plans[point] = conversations(
                self.num_conversations,
                self.turns,
                self.input_len,
                self.turn_input_len,
                self.output_len,
                range_ratio=self.range_ratio,
                think_time_s=self.think_time_s,
                seed=self.seed,
                point=point,
                tokenizer=self.tokenizer,
                corpus=self.corpus,
            )
        return self.plans[point]

    def total(self) -> int:
        return self.num_conversations * self.turns

    def max_in_flight(self) -> int:
        return self.num_conversations

    def warmup_requests(self, n: int) -> list[BenchRequest]:
        return _warmup(n, self.input_len, self.output_len, self.seed, self.tokenizer, self.corpus)

    async def run(
        self,
        client: httpx.AsyncClient,
        cfg: EndpointConfig,
        load: LoadPoint,
        point: int,
        seed: int,
        on_done: Callable[[RequestRecord], None] | None,
    ) -> tuple[list[RequestRecord], float]:
        return await run_conversations(client, cfg, self.plan(point), load, seed=seed, on_done=on_done)

    def metrics(self, records: list[RequestRecord]) -> dict[str, Any]:
        return multi_turn_metrics(records)


@dataclass
class SharedPrefixWorkload:
    """`pdserve bench --workload shared-prefix`: fresh prefixes and requests at every load point."""

    num_prompts: int
    num_prefixes: int
    prefix_len: int
    input_len: int
    output_len: int
    range_ratio: float
    seed: int
    endpoint: str
    tokenizer: TextTokenizer | None = None
    corpus: str | None = None

    def total(self) -> int:
        return self.num_prompts

    def max_in_flight(self) -> int:
        return self.num_prompts

    def warmup_requests(self, n: int) -> list[BenchRequest]:
        return _warmup(n, self.prefix_len + self.input_len, self.output_len, self.seed, self.tokenizer, self.corpus)

    async def run(
        self,
        client: httpx.AsyncClient,
        cfg: EndpointConfig,
        load: LoadPoint,
        point: int,
        seed: int,
        on_done: Callable[[RequestRecord], None] | None,
    ) -> tuple[list[RequestRecord], float]:
        work = shared_prefix_requests(
            self.num_prompts,
            self.num_prefixes,
            self.prefix_len,
            self.input_len,
            self.output_len,
            self.endpoint,
            range_ratio=self.range_ratio,
            seed=self.seed,
            point=point,
            tokenizer=self.tokenizer,
            corpus=self.corpus,
        )
        records, wall = await run_point(client, cfg, work.requests, load, seed=seed, on_done=on_done)
        mark_shared_prefix(records, work.prefix_of, self.prefix_len)
        return records, wall

    def metrics(self, records: list[RequestRecord]) -> dict[str, Any]:
        return shared_prefix_metrics(records)


def _warmup(
    n: int, input_len: int, output_len: int, seed: int, tokenizer: TextTokenizer | None, corpus: str | None
) -> list[BenchRequest]:
    if n <= 0:
        return []
    return random_requests(n, input_len, output_len, seed=seed + WARMUP_SEED, tokenizer=tokenizer, corpus=corpus)
