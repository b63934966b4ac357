"""A message of several tokens gives a choice the same text, count and finish as one token a message."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.tokenizer import Tokenizer
from router.contract import TokenEvent
from router.text import ChoiceText, TextOptions

TEXT = "Prefill runs the prompt; decode streams 世界 one token at a time, émigré café ✓ done. " * 3


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def _run(choice: ChoiceText, ids: list[int], sizes: list[int]) -> tuple[str, int, str | None]:
    streamed, i = "", 0
    for n in sizes:
        if i >= len(ids) or choice.finished:
            break
        streamed += choice.feed(TokenEvent(tuple(ids[i : i + n]))).text
        i += n
    return streamed, choice.tokens, choice.finish_reason


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("case", ["plain", "end_id", "stop", "min_tokens"])
def test_runs_of_tokens_equal_one_token_a_message(tok: Tokenizer, seed: int, case: str) -> None:
    rng = random.Random(seed)
    ids = tok.encode(TEXT, add_special_tokens=False)
    eos = tok.token_to_id("<|eos|>")
    assert eos is not None
    if case == "end_id":
        ids.insert(rng.randrange(len(ids)), eos)  # an end id inside a message: shown as nothing
    stop = ("café",) if case == "stop" else ()
    options = TextOptions(min_tokens=5 if case == "min_tokens" else 0)

    def choice() -> ChoiceText:
        return ChoiceText(tok, [1, 2, 3], stop=stop, end_ids=frozenset({eos}), options=options)

    one = _run(choice(), ids, [1] * len(ids))
    runs = _run(choice(), ids, [rng.randint(2, 16) for _ in range(len(ids))])
    assert runs[0] == one[0] and runs[2] == one[2]
    if case == "stop":
        assert one[2] == "stop" and "café" not in one[0] and runs[1] == one[1]  # counted to the stop
    else:
        assert one[0] == tok.decode([t for t in ids if t != eos]) and runs[1] == one[1] == len(ids)
