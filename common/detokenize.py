"""Incremental detokenizing with stop strings: token ids -> text safe to show, cut at a stop string.

The one implementation the engine (stop strings on a node) and the router (the text clients see)
both use. Torch-free.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, never splitting a UTF-8 character.

    Keeps a small window of ids: `prefix` tokens (already emitted, kept as context so decoders that
    depend on the previous token, e.g. SentencePiece's leading space, decode consistently) followed
    by pending tokens. Each call decodes only that window, so the cost is proportional to the new
    tokens (plus the previous emission), not to the sequence length.
    """

    _CONTEXT_TOKENS = 6  # prompt tokens kept as left context for the first output tokens
    _MAX_UTF8_TOKENS = 4  # a UTF-8 character is at most 4 bytes, hence at most 4 tokens
    _MAX_PENDING = 16  # past this, held-back tokens are undecodable garbage, not a partial character

    def __init__(
        self, tokenizer: _Decoder, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = list(prompt_ids[-self._CONTEXT_TOKENS :]) if prompt_ids else []
        self._read = len(self._window)  # window[:_read] is emitted context, window[_read:] pending

    def feed(self, token_ids: int | Sequence[int]) -> str:
        """Add generated ids; return the text they completed (possibly empty)."""
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if not new:
            return ""
        self._window.extend(new)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (a trailing U+FFFD included)."""
        return self._advance(final=True) if len(self._window) > self._read else ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _advance(self, final: bool) -> str:
        window, read = self._window, self._read
        n = len(window)
        prefix_text = self._decode(window[:read])
        full = self._decode(window)
        if final or (len(full) > len(prefix_text) and not full.endswith(REPLACEMENT_CHAR)):
            return self._emit(full[len(prefix_text) :], n)
        garbage = n - read > self._MAX_PENDING
        if not full.endswith(REPLACEMENT_CHAR):
            # No new text (e.g. skipped special tokens): slide the window once it gets long.
            return self._emit(full[len(prefix_text) :], n) if garbage else ""
        # The tail may be a character still arriving. Emit up to the latest cut that ends on a whole
        # character, so a chunk ending mid-character does not hold back everything before it.
        if not garbage:
            for k in range(n - 1, max(read, n - self._MAX_UTF8_TOKENS), -1):
                cut_text = self._decode(window[:k])
                if (
                    len(cut_text) > len(prefix_text)
                    and not cut_text.endswith(REPLACEMENT_CHAR)
                    and full.startswith(cut_text)
                ):
                    return self._emit(cut_text[len(prefix_text) :], k)
            return ""
        # Long undecodable runs (random models emit those): bytes before n-3 are followed by at least
        # 3 more, enough to settle every UTF-8 sequence, so emitting them (U+FFFD included) matches
        # the final decode. Look back a few cuts for one that agrees with the full decode.
        for k in range(n - (self._MAX_UTF8_TOKENS - 1), max(read, n - 2 * self._MAX_UTF8_TOKENS), -1):
            cut_text = self._decode(window[:k])
            if len(cut_text) > len(prefix_text) and full.startswith(cut_text):
                return self._emit(cut_text[len(prefix_text) :], k)
        return self._emit(full[len(prefix_text) :], n)

    def _emit(self, text: str, upto: int) -> str:
        # The just-emitted tokens become the next call's prefix context; older ones are dropped.
        old_read = self._read
        self._window = self._window[old_read:]
        self._read = upto - old_read
        return text


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any stop string.

    Text that could be the start of a stop string is held back until the next delta decides it, so
    the emitted text never contains (any part of) a stop string that then completes.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._stops = tuple(dict.fromkeys(stop))
        self._held = ""
        self._floor = 0  # leading chars of `_held` that no match may end in (see `feed`)
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def feed(self, delta: str, *, can_stop: bool = True) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit).

        `can_stop=False` marks `delta` as text no stop string may end in (the output of the first
        min_tokens tokens): a match ending there is ignored, one that starts there and ends in
        a later delta still counts.
        """
        if self.stopped:
            return "", True
        buf = self._held + delta
        floor = len(buf) if not can_stop else self._floor
        hit, hit_at = None, len(buf)
        for s in self._stops:
            # only a match ending past `floor` and starting before the best so far
            i = buf.find(s, max(0, floor - len(s) + 1), hit_at + len(s) - 1)
            if i != -1 and i < hit_at:
                hit, hit_at = s, i
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit, ""
            return buf[:hit_at], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        self._floor = max(0, floor - (len(buf) - keep))
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """At the end of the stream: the held-back text, which turned out not to be a stop string."""
        held, self._held, self._floor = self._held, "", 0
        return "" if self.stopped else held

    def _partial_suffix_len(self, buf: str) -> int:
        return partial_suffix_len(buf, self._stops)


def partial_suffix_len(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns` (text to
    hold back: what comes next may complete the pattern)."""
    best = 0
    for s in patterns:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextAssembler:
    """Feeds new token ids, returns the text safe to show and whether a stop string was hit.

    No stop string may end in the text of the first `min_tokens` tokens (vLLM's min_tokens); text a
    partial character held back past that boundary counts as after it. Tokens that count toward
    `min_tokens` but show no text (ids that end generation) are counted with `skip`.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        stop: Sequence[str],
        prompt_ids: Sequence[int] = (),
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stop = StopStringMatcher(stop) if stop else None
        self._min_tokens = min_tokens
        self._seen = 0  # tokens counted so far (fed or skipped)

    @property
    def has_stops(self) -> bool:
        return self._stop is not None

    @property
    def matched(self) -> str | None:
        """The stop string that was hit, if any."""
        return self._stop.matched if self._stop is not None else None

    def skip(self, n: int = 1) -> None:
        """Count `n` tokens that show no text (they still count toward `min_tokens`)."""
        self._seen += n

    def feed(self, token_ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        short = max(0, min(len(token_ids), self._min_tokens - self._seen))  # tokens still below min
        self._seen += len(token_ids)
        out, hit = self._match(self._detok.feed(token_ids[:short]), can_stop=False) if short else ("", False)
        if not hit:
            text = self._detok.feed(token_ids[short:]) + (self._detok.flush() if final else "")
            more, hit = self._match(text, can_stop=self._seen > self._min_tokens)
            out += more
        if final and not hit:
            out += self.release()
        return out, hit

    def flush(self) -> tuple[str, bool]:
        """At the end: the detokenizer's held-back text, matched; text held as a possible stop
        string start stays held (see `release`)."""
        return self._match(self._detok.flush(), can_stop=self._seen > self._min_tokens)

    def release(self) -> str:
        """Text held back as a possible stop string start, which turned out not to be one."""
        return self._stop.flush() if self._stop is not None else ""

    def _match(self, text: str, can_stop: bool) -> tuple[str, bool]:
        return (text, False) if self._stop is None else self._stop.feed(text, can_stop=can_stop)

    def close(self) -> str:
        """Text still held back when the stream ends early (nothing after a stop string)."""
        return "" if self._stop is not None and self._stop.stopped else self._detok.flush()
