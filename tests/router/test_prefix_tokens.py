"""The router's prefix token cache: a chat's next turn tokenizes only what is new, and its ids are
always the whole encode's (checked on the tokenizer at start and on sampled prompts after)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from common.tokenizer import Tokenizer
from fixtures.tiny_model import build_tokenizer
from router.prefix_tokens import PrefixTokenCache, PrefixTokenCollector
from trainer.tokenizer import ASSISTANT, BOS, CHAT_TEMPLATE, EOS, SPECIAL_TOKENS, SYSTEM, USER

WORDS = "def return self import class for while if else print value result naïve ☕ 12 + 30".split()


def _tokenizer(style: str) -> Tokenizer:
    return Tokenizer(
        build_tokenizer(style),
        name_or_path=style,
        bos_token=BOS if style == "llama" else None,
        eos_token=EOS,
        chat_templates={"default": CHAT_TEMPLATE},
    )


def _metaspace() -> Tokenizer:
    """A SentencePiece-like tokenizer: Metaspace prepends its marker to an input's first piece only."""
    backend = Backend(models.BPE(unk_token=EOS))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    backend.train_from_iterator([" ".join(WORDS * 40)], trainer=trainer)
    return Tokenizer(backend, name_or_path="metaspace", eos_token=EOS, chat_templates={"default": CHAT_TEMPLATE})


def _turns(tok: Tokenizer, n: int, seed: int = 0) -> list[str]:
    """The rendered prompt of each turn of one conversation: each re-sends the whole history."""
    rng, chat, out = random.Random(seed), [{"role": "system", "content": "be brief"}], []
    for t in range(n):
        chat.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40 + t))})
        out.append(tok.apply_chat_template(chat, add_generation_prompt=True))
        chat.append({"role": "assistant", "content": " " + " ".join(rng.choice(WORDS) for _ in range(30))})
    return out


@pytest.mark.parametrize("style", ["llama", "qwen"])
def test_a_conversations_turns_reuse_the_ids_of_its_history(style: str) -> None:
    tok = _tokenizer(style)
    cache = PrefixTokenCache(tok, verify_every=1)  # every hit also checked against a whole encode
    assert cache.enabled
    turns = _turns(tok, 8)
    for add_special in (False, True):
        for text in turns:
            assert cache.encode(text, add_special) == tok.encode(text, add_special_tokens=add_special)
    assert cache.enabled and cache.stats.hits == 14 and cache.stats.misses == 2
    assert cache.stats.reused_tokens > sum(len(tok.encode(t, add_special_tokens=False)) for t in turns) // 2
    plain = "no special token here " * 20  # nothing to cut at: encoded whole, nothing kept
    assert cache.encode(plain, True) == tok.encode(plain, add_special_tokens=True)


def test_whatever_the_tokenizer_the_ids_are_the_whole_encodes() -> None:
    """Metaspace marks an input's first piece, which a cut before a special token leaves alone: the
    probe finds the ids equal and keeps the cache on. Whatever the tokenizer, a prompt's ids are
    what a whole encode gives (the probe turns the cache off where they would not be)."""
    tok = _metaspace()
    cache = PrefixTokenCache(tok, verify_every=1)
    for text in _turns(tok, 5, seed=1):
        assert cache.encode(text, False) == tok.encode(text, add_special_tokens=False)
    assert cache.enabled and cache.stats.hits == 4
    no_specials = Tokenizer(build_tokenizer("qwen"), chat_templates={"default": CHAT_TEMPLATE})
    no_specials.backend.add_tokens(["<|plain|>"])  # an added token that is not special: no cut
    assert PrefixTokenCache(no_specials).enabled  # the chat specials are there still


def test_a_sampled_mismatch_turns_the_cache_off_and_the_prompt_keeps_its_whole_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = _tokenizer("llama")
    cache = PrefixTokenCache(tok, verify_every=1)
    first, second = _turns(tok, 2)
    cache.encode(first, False)
    key = next(iter(cache._kept))
    cache._kept[key] = cache._kept[key][:-1]  # a kept prefix gone wrong: a token short
    assert cache.encode(second, False) == tok.encode(second, add_special_tokens=False)  # the mismatched one too
    assert not cache.enabled and "prefix token cache off" in caplog.text
    assert cache.encode(second, False) == tok.encode(second, add_special_tokens=False)


def test_kept_prefixes_stay_within_their_budget_and_the_metrics_show_the_cache() -> None:
    tok = _tokenizer("qwen")
    turns = [t for seed in range(6) for t in _turns(tok, 3, seed=seed)]
    budget = 3 * max(len(t) for t in turns)
    cache = PrefixTokenCache(tok, max_bytes=budget)
    for text in turns:
        cache.encode(text, False)
    assert 0 < cache._bytes <= budget and len(cache._kept) < len(turns)  # the oldest went
    registry = CollectorRegistry()
    registry.register(PrefixTokenCollector(cache))
    assert (
        registry.get_sample_value("pdserve_router_prompt_prefix_lookups_total", {"result": "hit"}) == cache.stats.hits
    )
    assert registry.get_sample_value("pdserve_router_prompt_tokens_reused_total") == cache.stats.reused_tokens
    assert registry.get_sample_value("pdserve_router_prompt_prefix_cache_enabled") == 1.0


def test_the_specials_the_template_starts_messages_with_are_the_cuts() -> None:
    tok = _tokenizer("qwen")
    assert {SYSTEM, USER, ASSISTANT} <= set(PrefixTokenCache(tok)._specials)


def test_a_zero_budget_turns_the_cache_off_and_a_negative_one_is_refused() -> None:
    tok = _tokenizer("qwen")
    off = PrefixTokenCache(tok, max_bytes=0)
    text = _turns(tok, 2)[1]
    assert not off.enabled and off.encode(text, False) == tok.encode(text, add_special_tokens=False)
    assert off.stats.hits == off.stats.misses == 0
    with pytest.raises(ValueError, match="--prompt-prefix-cache-mb"):
        PrefixTokenCache(tok, max_bytes=-1)


def test_a_special_token_that_takes_the_space_before_it_is_no_cut() -> None:
    """An lstrip special token swallows the whitespace before it, so a cut just before it would
    tokenize that space on its own: such tokens are not cuts, and ids stay the whole encode's."""
    from tokenizers import AddedToken

    tok = _tokenizer("qwen")
    tok.backend.add_special_tokens([AddedToken("<|mark|>", special=True, lstrip=True)])
    cache = PrefixTokenCache(tok, verify_every=1)
    assert "<|mark|>" not in cache._specials and cache.enabled
    text = _turns(tok, 2)[1] + " see <|mark|> and  <|mark|>"
    for _ in range(2):
        assert cache.encode(text, False) == tok.encode(text, add_special_tokens=False)
    assert cache.enabled
