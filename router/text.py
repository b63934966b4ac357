"""Per-choice text assembly: token ids -> text deltas, exact stop-string cuts, echo, logprobs.

Special tokens are shown or not (skip_special_tokens), a stop string is kept on request
(include_stop_str_in_output) and never ends a choice inside its first min_tokens tokens' text.

The router is the authority on text. Nodes also get the stop strings and may stop early, but what
reaches the client is decided here, the same way for streamed and non-streamed responses (both use
`ChoiceText`), so that the concatenated stream always equals the non-streamed text. With tools, a
parser per choice (router/tools/) splits that text into content and tool calls, again the same way
for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from common.detokenize import TextAssembler
from common.tokenizer import Tokenizer
from router.contract import FinishEvent, TokenEvent
from router.protocol import Shapes, usage
from router.tools.base import ToolParser


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    text_offset: int  # where the token's text starts in the choice's text (completions format)


@dataclass
class Delta:
    """What one event adds to a choice: text safe to show now, the logprobs of its tokens, and (with
    tools) OpenAI tool-call delta entries."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TextOptions:
    """How a choice's tokens become text (vLLM's names): special tokens shown or not, the stop string
    kept or cut, the first `min_tokens` tokens' text never ending the choice, an echoed prefix."""

    skip_special_tokens: bool = True
    include_stop_str: bool = False
    min_tokens: int = 0
    echo: str = ""  # shown before the generated text (the prompt, or the continued message)


class ChoiceText:
    """Text, token count and finish reason of one choice (one GenerationJob).

    `end_ids` are tokens that end generation (stop_token_ids, and EOS unless ignore_eos): their
    text is never shown, as in OpenAI/vLLM, and skipping them up front means it never has to be
    taken back from a stream that already sent it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        end_ids: frozenset[int] = frozenset(),
        logprobs: bool = False,
        options: TextOptions = TextOptions(),
    ) -> None:
        self._tok = tokenizer
        self._text = TextAssembler(tokenizer, stop, prompt_ids, options.min_tokens, options.skip_special_tokens)
        self._end_ids = end_ids
        self._want_logprobs = logprobs
        self._opt = options
        self.echo = options.echo
        self.text = ""  # generated text only (the echo is added where the choice is rendered)
        self.tokens = 0  # tokens consumed from the node (all of them, end ids included)
        self.cached_tokens = 0  # of its prompt, found in the prefix cache (known at its finish)
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, event: TokenEvent) -> Delta:
        """Consume one event's tokens; stops at the token that completes a stop string.

        `finished` turning true here means the router hit a stop string before the node finished:
        the caller must cancel the job (which aborts both legs).
        """
        delta = Delta()
        if self.finished:
            return delta
        ids = event.token_ids
        if len(ids) > 1 and not self._text.has_stops and not self._want_logprobs and self._end_ids.isdisjoint(ids):
            # nothing to cut at and no per-token offsets: the message's tokens in one feed (the
            # detokenizer's text is the same however its input is split; token by token, each of
            # a message's tokens cost the router two decodes of the detokenizer's window)
            self.tokens += len(ids)
            delta.text, _ = self._text.feed(ids)
            self.text += delta.text
            return delta
        # Token by token, so the token count and logprobs end exactly at the stop string.
        for k, tid in enumerate(event.token_ids):
            self.tokens += 1
            if self._want_logprobs and k < len(event.logprobs):
                entry = self._logprob(tid, event, k, len(self.text) + len(delta.text))
                delta.logprobs.append(entry)
                self.logprobs.append(entry)
            if tid in self._end_ids:
                self._text.skip()
                continue
            # no stop string may end in the text of the first min_tokens tokens
            safe, hit = self._text.feed([tid])
            delta.text += safe + (self._kept_stop() if hit else "")
            if hit:
                self.finish_reason = "stop"
                break
        self.text += delta.text
        return delta

    def finish(self, event: FinishEvent) -> Delta:
        """The node finished: release held-back text, cut at any stop string, settle the reason."""
        self.cached_tokens = event.cached_tokens
        if self.finished:
            return Delta()
        out, hit = self._text.flush()
        reason = event.finish_reason
        if self._text.has_stops:
            if hit:
                reason = "stop"
                out += self._kept_stop()
            else:
                held = self._text.release()
                if isinstance(event.matched_stop, str):
                    # The node saw its stop string start inside the text we were holding back (its
                    # detokenization may differ at the edge): never show text from there on.
                    held = held[: _stop_start(held, event.matched_stop)]
                    held += event.matched_stop if self._opt.include_stop_str else ""
                out += held
        # Trust the node's count unless it is short of what we saw (it may count differently).
        self.tokens = max(self.tokens, event.completion_tokens)
        self.text += out
        self.finish_reason = reason
        return Delta(out)

    def _kept_stop(self) -> str:
        """The stop string that was hit, when the client asked to keep it (include_stop_str_in_output)."""
        return (self._text.matched or "") if self._opt.include_stop_str else ""

    def _logprob(self, tid: int, event: TokenEvent, k: int, offset: int) -> TokenLogprob:
        top = event.top_logprobs[k] if k < len(event.top_logprobs) else ()
        return TokenLogprob(
            tid, self._piece(tid), float(event.logprobs[k]), tuple((self._piece(t), float(lp)) for t, lp in top), offset
        )

    def _piece(self, tid: int) -> str:
        # A lone byte token of a multi-byte character decodes to U+FFFD, as in OpenAI's `token`.
        return self._tok.decode([tid], skip_special_tokens=False)


def _stop_start(text: str, stop: str) -> int:
    """Index of the longest suffix of `text` that is a prefix of `stop` (len(text) if none)."""
    for k in range(min(len(stop), len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return len(text) - k
    return len(text)


def completion_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def chat_logprobs(entries: Sequence[TokenLogprob], top_n: int) -> dict[str, Any]:
    """The chat shape: one object per token with its UTF-8 bytes and `top_n` alternatives."""

    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:top_n]]} for e in entries
        ],
        "refusal": None,
    }


class RequestOutput:
    """All choices of one HTTP request, rendered in OpenAI's shapes (non-streamed or as chunks)."""

    def __init__(
        self,
        shapes: Shapes,
        choices: list[ChoiceText],
        prompt_tokens: int,
        top_logprobs: int,
        logprobs: bool,
        choices_per_prompt: int = 1,
        parsers: list[ToolParser] | None = None,
    ) -> None:
        self.shapes, self.choices, self.prompt_tokens = shapes, choices, prompt_tokens
        self.parsers = parsers  # one tool-call parser per choice, or None
        self._top, self._logprobs = top_logprobs, logprobs
        self._per_prompt = max(1, choices_per_prompt)
        self.disaggregated = True  # false once any choice was served by a colocated node

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a prefix cache, once per prompt (its choices ran it each:
        the one that found most counts)."""
        n = self._per_prompt
        return sum(max(c.cached_tokens for c in self.choices[i : i + n]) for i in range(0, len(self.choices), n))

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def apply(self, index: int, event: TokenEvent | FinishEvent) -> Delta:
        if isinstance(event, TokenEvent):
            delta = self.choices[index].feed(event)
        else:
            self.disaggregated = self.disaggregated and event.disaggregated
            delta = self.choices[index].finish(event)
        return delta if self.parsers is None else self._tool_delta(self.parsers[index], index, delta)

    def _tool_delta(self, parser: ToolParser, index: int, delta: Delta) -> Delta:
        """The choice's text split into content and tool calls by its parser."""
        found = parser.feed(delta.text)
        if self.choices[index].finished:
            found += parser.finish()
        return Delta(found.content, delta.logprobs, found.calls)

    def finish_reason(self, index: int) -> str | None:
        """The choice's finish reason; "tool_calls" when it stopped after calling tools."""
        reason = self.choices[index].finish_reason
        if reason == "stop" and self.parsers and self.parsers[index].calls:
            return "tool_calls"
        return reason

    def _render_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        return chat_logprobs(entries, self._top) if self.shapes.chat else completion_logprobs(entries)

    def response(self) -> dict[str, Any]:
        return self.shapes.response([self._choice(i, c) for i, c in enumerate(self.choices)], self.usage())

    def _choice(self, i: int, c: ChoiceText) -> dict[str, Any]:
        if self.parsers is None:
            return self.shapes.choice(i, c.echo + c.text, self._render_logprobs(c.logprobs), c.finish_reason)
        calls = [call.message_entry() for call in self.parsers[i].calls]
        content = c.echo + self.parsers[i].content
        return self.shapes.choice(i, content, self._render_logprobs(c.logprobs), self.finish_reason(i), calls)

    def opening_chunks(self) -> list[dict[str, Any]]:
        """The echoed text of each choice, streamed before anything it generates."""
        return [self.shapes.chunk(i, c.echo) for i, c in enumerate(self.choices) if c.echo]

    def chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        """The chunks one applied event produces: its text/logprobs, then the finish if it finished."""
        out = []
        if delta.text or delta.logprobs or delta.tool_calls:
            text = delta.text if delta.text or not delta.tool_calls else None
            logprobs = self._render_logprobs(delta.logprobs)
            out.append(self.shapes.chunk(index, text, logprobs, tool_calls=delta.tool_calls))
        if self.choices[index].finished:
            out.append(self.shapes.chunk(index, finish=self.finish_reason(index)))
        return out
