"""The llguidance backend: grammars compiled by llguidance over the node's tokenizer.json."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import llguidance
import torch

from common.sampling import InvalidRequest
from engine.grammar.base import GrammarMatcher, checked_json

# JSON as json.dumps writes it, no free whitespace: what OpenAI's structured output returns, and a
# weak model cannot wander into endless whitespace (a schema's "x-guidance" may say otherwise).
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher:
    """A GrammarMatcher over an llguidance LLMatcher."""

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self._m = m

    def advance(self, tokens: Sequence[int]) -> bool:
        toks = list(tokens)
        # an LLMatcher that refuses a token enters a sticky error state: check first
        if self._m.validate_tokens(toks) != len(toks):
            return False
        return self._m.consume_tokens(toks)

    def rollback(self, k: int) -> None:
        if k and not self._m.rollback(k):
            raise RuntimeError(f"grammar rollback of {k} tokens failed: {self._m.get_error()}")

    def validate(self, tokens: Sequence[int]) -> int:
        return self._m.validate_tokens(list(tokens))

    def fill_mask(self, words: torch.Tensor) -> None:
        # llguidance writes through the raw pointer: it must be this tensor's own memory
        if words.dtype != torch.int32 or not words.is_cpu or not words.is_contiguous():  # is_cpu: no device object
            raise ValueError("a mask row must be a contiguous int32 CPU tensor")
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def is_finished(self) -> bool:
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def forced_tokens(self) -> list[int]:
        return self._m.compute_ff_tokens()


class LLGuidanceGrammar:
    """A validated llguidance grammar: each request deep-copies the pristine matcher."""

    def __init__(self, pristine: llguidance.LLMatcher) -> None:
        self._pristine = pristine

    def matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._pristine.deep_copy())


class LLGuidanceBackend:
    """Compiles constraints with llguidance for a tokenizer.json vocabulary of `vocab_size` ids
    (the model's, which may exceed the tokenizer's: the extra ids are never allowed)."""

    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))

    @classmethod
    def from_dir(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> "LLGuidanceBackend":
        return cls((Path(model_dir) / "tokenizer.json").read_text(), vocab_size, eos_token_ids)

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        grammar = _grammar_text(kind, spec, self.tokenizer)
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequest(f"{kind} constraint: {_one_line(m.get_error())}")
        return LLGuidanceGrammar(m)


def _grammar_text(kind: str, spec: str, tokenizer: llguidance.LLTokenizer) -> str:
    """llguidance's grammar for a constraint; InvalidRequest for text that is not even parseable."""
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(checked_json(spec), defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "ebnf":
            return llguidance.grammar_from("ebnf", spec)
        if kind == "structural_tag":
            return _structural_tag(spec, tokenizer)
    except (ValueError, TypeError, KeyError, AssertionError) as e:
        raise InvalidRequest(f"{kind} constraint: {_one_line(str(e)) or type(e).__name__}") from None
    raise InvalidRequest(f"constraint kind {kind!r} is not supported by the llguidance backend")


def _structural_tag(spec: str, tokenizer: llguidance.LLTokenizer) -> str:
    """SGLang's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}):
    free text in which each begin string, once a trigger starts it, is followed by JSON of its
    schema and then its end string. Triggers are matched as special tokens only where every one
    is a special token of this vocabulary (Qwen's <tool_call>); elsewhere as text. An end that is
    a special token (Qwen's </tool_call>) is that token, by id: as text it would ban the very
    token a model emits there."""
    tag = json.loads(spec)
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise ValueError("expected an object with a non-empty 'structures' list")
    triggers = [t for t in tag.get("triggers", []) if isinstance(t, str) and t]
    tags, end_tokens = [], {}
    for i, s in enumerate(tag["structures"]):
        begin, end = s["begin"], s["end"]
        trigger = next((t for t in triggers if begin.startswith(t)), begin)
        if end and _is_special(tokenizer, end):
            end_tokens[i], end = tokenizer.tokenize_bytes(end.encode(), parse_special=True)[0], ""
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=s.get("schema", {}), end=end))
    special = all(_is_special(tokenizer, t.trigger) for t in tags)
    return _end_with_tokens(llguidance.StructTag.to_grammar(tags, assume_special=special), end_tokens)


def _end_with_tokens(grammar: str, end_tokens: dict[int, int]) -> str:
    """Each tag rule `tag_i` of StructTag's Lark grammar, ending with its end token (by id)."""
    if not end_tokens:
        return grammar
    doc = json.loads(grammar) if grammar.lstrip().startswith("{") else None  # with side grammars
    lark = doc["grammars"][0]["lark_grammar"] if doc is not None else grammar
    for i, token in end_tokens.items():
        lark, n = re.subn(rf"^(tag_{i}: .*)$", rf"\1 <[{token}]>", lark, count=1, flags=re.M)
        if n != 1:
            raise ValueError(f"structural tag {i}: no rule to end with its end token")
    if doc is None:
        return lark
    doc["grammars"][0]["lark_grammar"] = lark
    return json.dumps(doc)


def _is_special(tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    ids = tokenizer.tokenize_bytes(text.encode(), parse_special=True)
    return len(ids) == 1 and tokenizer.is_special_token(ids[0])


def _one_line(msg: str) -> str:
    """An error message on one line, short enough for an HTTP 400 body."""
    one = " ".join(msg.split())
    return one if len(one) <= 300 else one[:297] + "..."
