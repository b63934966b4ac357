"""Token ids of a prompt's earlier prefix, kept: a chat's next turn tokenizes only what is new.

Every turn of a conversation re-sends its whole history, and the router tokenized all of it on its
one event loop (about 0.7 ms per thousand tokens on a 2-core VM, a third of its CPU for a
multi-turn chat against instant nodes; bench/RESULTS.md, router overhead). A fast tokenizer
splits its input at added special tokens before anything else, so a text cut just before one
tokenizes as its two halves do: chat templates start every message with such a token. The cache
keeps the ids of each prompt up to its last such cut, and a later prompt that starts with a kept
prefix encodes only the rest.

That property is checked, not assumed: on the tokenizer's own chat template when the cache is
made, and against a whole encode on one prompt in VERIFY_EVERY after; a mismatch turns the cache
off for good (a tokenizer whose pre-tokenizer treats the first piece of an input differently, say).
The router's --prompt-prefix-cache-mb bounds the kept text (0: off).
"""

from __future__ import annotations

import logging
import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.defaults import DEFAULT_PROMPT_PREFIX_CACHE_MB
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_BYTES = int(DEFAULT_PROMPT_PREFIX_CACHE_MB * (1 << 20))  # kept prefixes: their text and 4-byte ids, all together
VERIFY_EVERY = 64  # one prompt in this many is also encoded whole and compared
PROBE_CHAT = [  # non-ASCII too: the cut is found by character offset
    {"role": "system", "content": "You are terse, naïve ☕ and exact."},
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": " Fine, thanks.  And you?"},
    {"role": "user", "content": "ok\n\nthen: 12 + 30"},
]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0


class PrefixTokenCache:
    """Encode prompts, reusing the ids of a kept prefix that ends just before a special token."""

    def __init__(self, tokenizer: Tokenizer, max_bytes: int = MAX_BYTES, verify_every: int = VERIFY_EVERY) -> None:
        if max_bytes < 0:
            raise ValueError(f"--prompt-prefix-cache-mb must be >= 0, got {max_bytes / (1 << 20):g}")
        self.tokenizer, self.max_bytes, self.verify_every = tokenizer, max_bytes, verify_every
        # ids as 4-byte arrays: a list of Python ints would cost 36 bytes a token, nine times the text
        self._kept: OrderedDict[tuple[bool, str], array[int]] = OrderedDict()
        self._bytes = 0
        self._seen = 0
        self.stats = CacheStats()
        self._specials = _special_tokens(tokenizer)
        self._cuts = re.compile("|".join(re.escape(t) for t in self._specials)) if self._specials else None
        self.enabled = max_bytes > 0 and self._cuts is not None and self._probe()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s ids, as `tokenizer.encode` gives them."""
        if not self.enabled:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert self._cuts is not None
        cuts = [m.start() for m in self._cuts.finditer(text) if m.start() > 0]
        start, head = self._longest_kept(text, cuts, add_special_tokens)
        enc = self.tokenizer.backend.encode(text[start:], add_special_tokens=add_special_tokens and start == 0)
        ids = head + enc.ids
        self._keep_last_cut(text, cuts, start, head, enc.ids, enc.offsets, add_special_tokens)
        self._seen += 1
        if start and self._seen % self.verify_every == 0:
            return self._verified(text, add_special_tokens, ids)
        return ids

    def _longest_kept(self, text: str, cuts: Sequence[int], add_special: bool) -> tuple[int, list[int]]:
        for cut in reversed(cuts):
            kept = self._kept.get((add_special, text[:cut]))
            if kept is not None:
                self._kept.move_to_end((add_special, text[:cut]))
                self.stats.hits += 1
                self.stats.reused_tokens += len(kept)
                return cut, kept.tolist()
        self.stats.misses += 1
        return 0, []

    def _keep_last_cut(
        self,
        text: str,
        cuts: Sequence[int],
        start: int,
        head: list[int],
        ids: list[int],
        offsets: Sequence[tuple[int, int]],
        add_special: bool,
    ) -> None:
        """Keep the ids of `text` up to its last cut past `start`: the next turn starts there."""
        if not cuts or cuts[-1] <= start:
            return
        cut = cuts[-1] - start
        # the first token at or past the cut (an added BOS has offsets (0, 0): before any cut)
        split = next((i for i, (begin, end) in enumerate(offsets) if begin >= cut and end > begin), None)
        if split is None:
            return
        key = (add_special, text[: cuts[-1]])
        if key in self._kept:
            return
        kept = self._kept[key] = array("i", head + ids[:split])
        self._bytes += _size(key[1], kept)
        while self._bytes > self.max_bytes and self._kept:
            (_, old_text), old_ids = self._kept.popitem(last=False)
            self._bytes -= _size(old_text, old_ids)

    def _verified(self, text: str, add_special: bool, ids: list[int]) -> list[int]:
        """The whole encode's ids; where `ids` differ from them, the cache turns off."""
        whole = self.tokenizer.encode(text, add_special_tokens=add_special)
        if whole != ids:
            self._off(f"a prompt's ids differed from its whole encode at {_first_difference(whole, ids)}")
        return whole

    def _probe(self) -> bool:
        """The property on this tokenizer's own template (or plain text with its special tokens)."""
        texts = [self._probe_text(n) for n in (3, 4)]
        self.enabled = True  # for `encode` to use the cache while probing
        for add_special in (False, True):
            for text in texts:  # the shorter first: the longer one then reuses its ids
                whole = self.tokenizer.encode(text, add_special_tokens=add_special)
                got = self.encode(text, add_special)
                if got != whole:
                    self._off(f"the probe's ids differed at {_first_difference(whole, got)}")
                    return False
        self._kept.clear()
        self._bytes, self._seen, self.stats = 0, 0, CacheStats()
        return True

    def _probe_text(self, messages: int) -> str:
        chat = PROBE_CHAT[:messages]
        if self.tokenizer.has_chat_template:
            try:
                return self.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
            except ValueError:
                pass
        return "".join(f"{self._specials[0]}{m['role']}\n{m['content']}" for m in chat)

    def _off(self, why: str) -> None:
        log.warning("prefix token cache off for %s: %s", self.tokenizer.name_or_path, why)
        self.enabled = False
        self._kept.clear()
        self._bytes = 0


class PrefixTokenCollector(Collector):
    """The cache's lookups and the tokens they saved encoding, at scrape time."""

    def __init__(self, cache: PrefixTokenCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.cache.stats
        lookups = CounterMetricFamily(
            "pdserve_router_prompt_prefix_lookups",
            "Text prompts looked up in the prefix token cache, by result (hit: only the rest was tokenized)",
            labels=["result"],
        )
        lookups.add_metric(["hit"], stats.hits)
        lookups.add_metric(["miss"], stats.misses)
        reused = CounterMetricFamily(
            "pdserve_router_prompt_tokens_reused", "Prompt tokens taken from the prefix token cache, not tokenized"
        )
        reused.add_metric([], stats.reused_tokens)
        on = GaugeMetricFamily(
            "pdserve_router_prompt_prefix_cache_enabled",
            "1 while the prefix token cache is on (it turns off on a mismatch)",
        )
        on.add_metric([], float(self.cache.enabled))
        yield lookups
        yield reused
        yield on


def _special_tokens(tokenizer: Tokenizer) -> list[str]:
    """The added special tokens a prompt may be cut before, longest first (so a pattern of them
    matches whole): not one that takes the whitespace before it (lstrip) or is matched on the
    normalized text, since a cut just before either is not where the tokenizer splits."""
    added = tokenizer.backend.get_added_tokens_decoder().values()
    cuts = {t.content for t in added if t.special and t.content and not t.lstrip and not t.normalized}
    return sorted(cuts, key=len, reverse=True)


def _size(text: str, ids: array[int]) -> int:
    """What a kept prefix costs against the budget: its text (a byte a character, near enough) and ids."""
    return len(text) + ids.itemsize * len(ids)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
