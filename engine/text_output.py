"""Per-request text assembly: incremental detokenization followed by exact stop-string trimming."""

from __future__ import annotations

from typing import Sequence

from pdserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class TextAssembler:
    """Feeds new token ids, returns the text safe to show and whether a stop string was hit.

    No stop string may end in the text of the first `min_tokens` tokens (vLLM's min_tokens); text a
    partial character held back past that boundary counts as after it.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], prompt_ids: Sequence[int] = (),
                 min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stop = StopStringMatcher(stop) if stop else None
        self._min_tokens = min_tokens
        self._seen = 0  # tokens fed so far

    @property
    def matched(self) -> str | None:
        """The stop string that was hit, if any."""
        return self._stop.matched if self._stop is not None else None

    def feed(self, token_ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        short = max(0, min(len(token_ids), self._min_tokens - self._seen))  # tokens still below min
        self._seen += len(token_ids)
        out, hit = self._match(self._detok.feed(token_ids[:short]), can_stop=False) if short else ("", False)
        if not hit:
            text = self._detok.feed(token_ids[short:]) + (self._detok.flush() if final else "")
            more, hit = self._match(text, can_stop=self._seen > self._min_tokens)
            out += more
        if final and not hit and self._stop is not None:
            out += self._stop.flush()
        return out, hit

    def _match(self, text: str, can_stop: bool) -> tuple[str, bool]:
        return (text, False) if self._stop is None else self._stop.feed(text, can_stop=can_stop)

    def close(self) -> str:
        """Text still held back when the stream ends early (nothing after a stop string)."""
        return "" if self._stop is not None and self._stop.stopped else self._detok.flush()
