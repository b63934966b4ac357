"""Per-request text assembly: incremental detokenization followed by exact stop-string trimming."""

from __future__ import annotations

from typing import Sequence

from pdserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class TextAssembler:
    """Feeds new token ids, returns the text safe to show and whether a stop string was hit."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], prompt_ids: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = StopStringMatcher(stop) if stop else None

    def feed(self, token_ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        text = self._detok.feed(token_ids)
        if final:
            text += self._detok.flush()
        if self._stop is None:
            return text, False
        out, hit = self._stop.feed(text)
        if final and not hit:
            out += self._stop.flush()
        return out, hit

    def close(self) -> str:
        """Text still held back when the stream ends early (nothing after a stop string)."""
        return "" if self._stop is not None and self._stop.stopped else self._detok.flush()
