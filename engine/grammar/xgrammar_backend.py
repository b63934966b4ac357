"""The xgrammar backend (optional, `--grammar-backend xgrammar`): the same matcher interface over xgrammar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import tokenizers
import torch
import xgrammar as xg

from common.sampling import InvalidRequest
from engine.grammar.base import GrammarMatcher, checked_json, mask_words


Encoder = Callable[[str], list[int]]  # text -> token ids, no special tokens


class XGrammarMatcher:
    """A GrammarMatcher over an xgrammar GrammarMatcher."""

    def __init__(self, m: Any, stop_ids: Sequence[int], vocab_size: int, encode: Encoder | None = None) -> None:
        self._m, self._stop, self._vocab, self._encode = m, tuple(stop_ids), vocab_size, encode

    def advance(self, tokens: Sequence[int]) -> bool:
        done = 0
        for t in tokens:
            if not self._m.accept_token(int(t)):
                self._m.rollback(done)
                return False
            done += 1
        return True

    def rollback(self, k: int) -> None:
        if k:
            self._m.rollback(k)

    def validate(self, tokens: Sequence[int]) -> int:
        n = 0
        for t in tokens:
            if not self._m.accept_token(int(t)):
                break
            n += 1
        self._m.rollback(n)
        return n

    def fill_mask(self, words: torch.Tensor) -> None:
        self._m.fill_next_token_bitmask(words.view(1, -1), 0)

    def is_finished(self) -> bool:
        if self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False
        # complete: finished when nothing but a stop token may follow (as llguidance says it)
        words = torch.zeros(mask_words(self._vocab), dtype=torch.int32)
        self.fill_mask(words)
        for t in self._stop:
            words[t // 32] &= ~(1 << (t % 32))
        return not bool(words.any())

    def is_accepting(self) -> bool:
        return self._m.is_completed()

    def forced_tokens(self) -> list[int]:
        """xgrammar offers the forced string: its tokens, as far as the grammar takes them."""
        text = self._m.find_jump_forward_string() if self._encode is not None else ""
        if not text:
            return []
        assert self._encode is not None
        tokens = self._encode(text)
        return tokens[: self.validate(tokens)]


class XGrammarGrammar:
    def __init__(self, compiled: Any, stop_ids: Sequence[int], vocab_size: int, encode: Encoder | None) -> None:
        self._compiled, self._stop, self._vocab, self._encode = compiled, stop_ids, vocab_size, encode

    def matcher(self) -> GrammarMatcher:
        m = xg.GrammarMatcher(self._compiled)
        return XGrammarMatcher(m, self._stop, self._vocab, self._encode)


class XGrammarBackend:
    """Compiles constraints with xgrammar (its own compile cache off; GrammarCompiler caches)."""

    name = "xgrammar"

    def __init__(self, info: Any, vocab_size: int, eos_token_ids: Sequence[int], encode: Encoder | None = None) -> None:
        self._compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._stop, self._vocab, self._encode = tuple(eos_token_ids), vocab_size, encode

    @classmethod
    def from_dir(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> "XGrammarBackend":
        from transformers import PreTrainedTokenizerFast  # xgrammar reads the vocabulary through it

        path = str(Path(model_dir) / "tokenizer.json")
        info = xg.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_file=path), vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        tok = tokenizers.Tokenizer.from_file(path)
        return cls(info, vocab_size, eos_token_ids, lambda text: tok.encode(text, add_special_tokens=False).ids)

    def compile(self, kind: str, spec: str) -> XGrammarGrammar:
        c = self._compiler
        try:
            if kind == "json_schema":
                compiled = c.compile_json_schema(checked_json(spec), any_whitespace=False, separators=(", ", ": "))
            elif kind == "regex":
                compiled = c.compile_regex(spec)
            elif kind == "ebnf":
                compiled = c.compile_grammar(spec)
            elif kind == "structural_tag":
                compiled = _structural_tag(c, spec)
            else:
                raise InvalidRequest(f"constraint kind {kind!r} is not supported by the xgrammar backend")
        except InvalidRequest:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError subclasses
            raise InvalidRequest(f"{kind} constraint: {' '.join(str(e).split())[:300]}") from None
        return XGrammarGrammar(compiled, self._stop, self._vocab, self._encode)


def _structural_tag(c: Any, spec: str) -> Any:
    """SGLang's legacy form ({"structures": [...], "triggers": [...]}) or xgrammar's own."""
    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xg.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in tag["structures"]
        ]
        return c.compile_structural_tag(items, list(tag.get("triggers", [])))
    return c.compile_structural_tag(spec)
