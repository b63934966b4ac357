"""Prefix-reuse workloads, generated from a seed: multi-turn conversations and shared system prompts.

Both cut their text from the same corpus as the random workload (loadgen/dataset.py: stdlib
source, exact token lengths with a tokenizer, ~4 characters per token without one), so prompts
are real text of controlled length. Content comes from `random.Random(f"<workload>:<seed>:<point>")`:
the same seed gives the same conversations, and each load point of a sweep gets its own, so a
point never hits the KV the previous point left in the server's prefix cache.

Multi-turn chat (`--workload multi-turn`): N conversations of T turns. Turn 1's user message is
`--input-len` tokens; every later turn adds a user message of `--turn-input-len` tokens; output
lengths follow `--output-len` (all lengths varied by `--range-ratio`). Turn t's request is the
whole history: every earlier user message and the server's actual replies, then the new message.
On the chat endpoint that is a message list; on the completions endpoint the previous prompt,
its reply, a blank line and the new message, so each prompt extends the last one verbatim.
Between a conversation's turns a user "thinks": exponential with mean `--think-time` seconds.

Shared system prompt (`--workload shared-prefix`): K system prompts of `--prefix-len` tokens;
each request takes one (seeded choice) followed by its own user part of `--input-len` tokens (a
system message then a user message on the chat endpoint, the two texts a blank line apart on the
completions endpoint).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from loadgen.dataset import BenchRequest, TextTokenizer, cut_prompt, load_corpus, sample_lengths

TURN_SEPARATOR = "\n\n"  # between a reply and the next user message in a completions transcript


@dataclass(frozen=True)
class Conversation:
    """One conversation's plan; index t of each tuple is turn t + 1."""

    id: int
    user_messages: tuple[str, ...]
    input_lens: tuple[int, ...]  # requested tokens of each user message
    output_lens: tuple[int, ...]  # max_tokens of each turn
    think_s: tuple[float, ...]  # pause before each turn (0 before the first)

    @property
    def turns(self) -> int:
        return len(self.user_messages)


def conversations(
    n: int,
    turns: int,
    first_input_len: int,
    turn_input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    think_time_s: float = 0.0,
    seed: int = 0,
    point: int = 0,
    tokenizer: TextTokenizer | None = None,
    corpus: str | None = None,
) -> list[Conversation]:
    """`n` conversations of `turns` turns for load point `point` (see the module docstring)."""
    if n < 1 or turns < 1:
        raise ValueError(f"need at least one conversation and one turn (got {n}, {turns})")
    if think_time_s < 0:
        raise ValueError(f"think time must be >= 0 s, not {think_time_s:g}")
    rng = random.Random(f"multi-turn:{seed}:{point}")
    corpus = corpus if corpus is not None else load_corpus()
    out = []
    for c in range(n):
        ins = sample_lengths(rng, 1, first_input_len, range_ratio) + sample_lengths(
            rng, turns - 1, turn_input_len, range_ratio
        )
        outs = sample_lengths(rng, turns, output_len, range_ratio)
        texts = tuple(cut_prompt(corpus, rng.randrange(len(corpus)), k, tokenizer) for k in ins)
        think = tuple(0.0 if t == 0 or think_time_s == 0 else rng.expovariate(1.0 / think_time_s) for t in range(turns))
        out.append(Conversation(c, texts, tuple(ins), tuple(outs), think))
    return out


def turn_request(
    conv: Conversation, turn: int, replies: Sequence[str], reply_tokens: Sequence[int], endpoint: str
) -> BenchRequest:
    """The request of 0-based `turn`, given the replies the server sent to the earlier turns."""
    if len(replies) != turn or len(reply_tokens) != turn:
        raise ValueError(f"turn {turn + 1} needs the {turn} earlier replies, got {len(replies)}")
    input_len = sum(conv.input_lens[: turn + 1]) + sum(reply_tokens)  # what the history should tokenize to
    index = conv.id * conv.turns + turn
    if endpoint == "chat":
        messages: list[dict[str, str]] = []
        for t in range(turn):
            messages.append({"role": "user", "content": conv.user_messages[t]})
            messages.append({"role": "assistant", "content": replies[t]})
        messages.append({"role": "user", "content": conv.user_messages[turn]})
        return BenchRequest(index, "", input_len, conv.output_lens[turn], messages=tuple(messages), keep_reply=True)
    prompt = conv.user_messages[0]
    for t in range(turn):
        prompt += replies[t] + TURN_SEPARATOR + conv.user_messages[t + 1]
    return BenchRequest(index, prompt, input_len, conv.output_lens[turn], keep_reply=True)


@dataclass(frozen=True)
class SharedPrefixSet:
    """One load point's requests and which system prompt each starts with."""

    prefixes: tuple[str, ...]
    requests: list[BenchRequest]
    prefix_of: tuple[int, ...]  # per request, in index (= send) order


def shared_prefix_requests(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    endpoint: str,
    *,
    range_ratio: float = 0.0,
    seed: int = 0,
    point: int = 0,
    tokenizer: TextTokenizer | None = None,
    corpus: str | None = None,
) -> SharedPrefixSet:
    """`n` requests behind `num_prefixes` system prompts of exactly `prefix_len` tokens (the user
    parts vary with `range_ratio`, the prefixes do not: their length is what a cache can reuse)."""
    if n < 1 or num_prefixes < 1 or prefix_len < 1:
        raise ValueError(f"need n, num_prefixes and prefix_len >= 1 (got {n}, {num_prefixes}, {prefix_len})")
    rng = random.Random(f"shared-prefix:{seed}:{point}")
    corpus = corpus if corpus is not None else load_corpus()
    prefixes = tuple(cut_prompt(corpus, rng.randrange(len(corpus)), prefix_len, tokenizer) for _ in range(num_prefixes))
    ins = sample_lengths(rng, n, input_len, range_ratio)
    outs = sample_lengths(rng, n, output_len, range_ratio)
    prefix_of = tuple(rng.randrange(num_prefixes) for _ in range(n))
    requests = []
    for i in range(n):
        system, user = prefixes[prefix_of[i]], cut_prompt(corpus, rng.randrange(len(corpus)), ins[i], tokenizer)
        if endpoint == "chat":
            messages = ({"role": "system", "content": system}, {"role": "user", "content": user})
            requests.append(BenchRequest(i, "", prefix_len + ins[i], outs[i], messages=messages))
        else:
            requests.append(BenchRequest(i, system + TURN_SEPARATOR + user, prefix_len + ins[i], outs[i]))
    return SharedPrefixSet(prefixes, requests, prefix_of)
