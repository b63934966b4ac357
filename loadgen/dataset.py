"""Random-length prompts cut from a demo corpus: the Python standard library's own source files.

Lengths: each request's input (output) length is drawn uniformly from
[ceil(L * (1 - range_ratio)), L] with a seeded RNG, so range_ratio 0 means exactly L.

Cutting a prompt to N tokens: with a tokenizer (the served model's HF directory) we encode a
window of the corpus, keep its first N ids and decode them; re-encoding that text gives N tokens
give or take one or two at the cut (BPE merges across the boundary), and the chat endpoint adds
its template's tokens on top. Without a tokenizer the length is approximated: N tokens ~ N * 4
characters (CHARS_PER_TOKEN), the usual rule of thumb for BPE tokenizers on English and code.
Either way the server's `usage.prompt_tokens` (when it sends usage) records the true count.
A prompt may also be a list of token ids (the completions endpoint takes them as they are): its
length is then exact.
"""

from __future__ import annotations

import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

CHARS_PER_TOKEN = 4
CORPUS_MAX_CHARS = 2_000_000  # plenty of distinct windows, read in well under a second


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str | list[int]  # text, or token ids (completions endpoint only)
    input_len: int  # requested prompt tokens
    output_len: int  # max_tokens sent
    timeout_s: float | None = None  # this request's whole-time limit instead of the endpoint's
    messages: tuple[dict[str, str], ...] | None = None  # chat endpoint: sent instead of `prompt`
    keep_reply: bool = False  # collect the reply's text (a conversation's next turn needs it)


def load_corpus(root: Path | None = None, max_chars: int = CORPUS_MAX_CHARS) -> str:
    """The stdlib's .py sources in sorted order, concatenated up to `max_chars` (deterministic)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a broken or non-UTF-8 file is just skipped
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    if size == 0:
        raise FileNotFoundError(f"no Python sources under {root} to build prompts from")
    return "".join(parts)[:max_chars]


def sample_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    if length < 1 or not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"need length >= 1 and 0 <= range_ratio <= 1 (got {length}, {range_ratio})")
    low = max(1, math.ceil(length * (1.0 - range_ratio)))
    return [rng.randint(low, length) for _ in range(n)]


def cut_prompt(corpus: str, offset: int, n_tokens: int, tokenizer: TextTokenizer | None) -> str:
    """About `n_tokens` tokens of corpus text starting at `offset` (wrapping around)."""
    if tokenizer is None:
        return _window(corpus, offset, n_tokens * CHARS_PER_TOKEN)
    width = n_tokens * 2 * CHARS_PER_TOKEN
    while True:
        # Whitespace-heavy code can run under 4 chars per token; widen until there are enough.
        ids = tokenizer.encode(_window(corpus, offset, width), add_special_tokens=False)
        if len(ids) >= n_tokens or width >= len(corpus):
            return tokenizer.decode(ids[:n_tokens], skip_special_tokens=True)
        width *= 2


def _window(corpus: str, offset: int, width: int) -> str:
    text = corpus[offset : offset + width]
    while len(text) < width:  # wrap around the end of the corpus
        text += corpus[: width - len(text)]
    return text


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer: TextTokenizer | None = None,
    corpus: str | None = None,
) -> list[BenchRequest]:
    """`n` requests with seeded random lengths and prompts from random corpus offsets (distinct
    offsets keep prefix caches from turning the benchmark into a cache benchmark)."""
    rng = random.Random(seed)
    corpus = corpus if corpus is not None else load_corpus()
    ins = sample_lengths(rng, n, input_len, range_ratio)
    outs = sample_lengths(rng, n, output_len, range_ratio)
    return [
        BenchRequest(i, cut_prompt(corpus, rng.randrange(len(corpus)), ins[i], tokenizer), ins[i], outs[i])
        for i in range(n)
    ]
