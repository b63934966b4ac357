"""Byte-level BPE trained on the corpus, saved as tokenizer.json + tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# The chat format of the built-in pair (the test fixtures' tiny models share it).
BOS, EOS, USER, ASSISTANT, SYSTEM = "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"
# The template carries its own BOS (as Llama 3's does; empty for the Qwen style), so callers
# tokenize a rendered chat with add_special_tokens=False; unknown roles fail loudly.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

PAD = "<|pad|>"
# Specials take ids 0..5 (bos, eos, pad first), then the 256 byte tokens, then merges.
SPECIAL_TOKENS = (BOS, EOS, PAD, SYSTEM, USER, ASSISTANT)


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE (whitespace runs kept as tokens: code indentation compresses)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # Like Llama 3: every plain encoding starts with BOS; chat templates render their own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """Files that common.tokenizer.Tokenizer and transformers' AutoTokenizer both load."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def special_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {name: tok.token_to_id(t) for name, t in (("bos", BOS), ("eos", EOS), ("pad", PAD))}
    missing = [n for n, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return {n: int(i) for n, i in ids.items() if i is not None}
