"""Tiny random-weight models in HF format, for tests and benchmarks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.config import parse_dtype

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

BOS, EOS, USER, ASSISTANT, SYSTEM = "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, SYSTEM)
# Specials first (ids 0..4), then the 256 byte tokens, then learned merges.
_TOKENIZER_VOCAB_SIZE = 512

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

# Training text for the BPE merges: English prose and Python, so demo prompts such as
# "def fibonacci(n):" tokenize into a mix of merged and single-byte tokens.
_BPE_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token of a
sequence from the tokens before it. The prefill phase reads the whole prompt at once; the decode
phase then generates one token at a time, reusing the key and value cache of the tokens before.
Speculative decoding lets a small draft model propose several tokens that the target model checks
in a single forward pass, and the accepted tokens are kept while the rest are thrown away.
Serving systems batch many requests together so that the accelerator stays busy, and they move the
cache between machines when prefill and decode run on different nodes of the cluster.

def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result = result * i
    return result


class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output = []

    def is_finished(self):
        return len(self.output) >= self.max_tokens


for index in range(10):
    print("hello world", index, fibonacci(index), factorial(index))
"""


# Qwen's pre-tokenizer split. transformers rebuilds Qwen2 tokenizers with it whatever
# tokenizer.json says, so the Qwen-style tiny tokenizers use it too and both sides agree.
_QWEN_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
TOKENIZER_STYLES = ("llama", "qwen")


def build_tokenizer(style: str = "llama") -> Tokenizer:
    """A real byte-level BPE: 256 byte tokens, the chat specials, and merges learned from a tiny text.

    "llama" (Llama 3 style) adds BOS to every encoding; "qwen" (Qwen2/3 style) uses Qwen's split
    regex and NFC normalizer and adds no BOS.
    """
    if style not in TOKENIZER_STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}; choose one of {', '.join(TOKENIZER_STYLES)}")
    tok = Tokenizer(models.BPE())
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_BPE_CORPUS], trainer=trainer)
    if style == "llama":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, tok.token_to_id(BOS))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(path: str | os.PathLike[str], *, style: str = "llama",
                    model_max_length: int = 512) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json into `path`; returns the tokenizer."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(style)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    llama = style == "llama"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast" if llama else "Qwen2Tokenizer",
        "bos_token": BOS if llama else None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": llama,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    return tok


def write_tiny_model(
    path: str | os.PathLike[str],
    arch: str = "LlamaForCausalLM",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 512,
    dtype: str = "float32",
    shards: int = 1,
) -> Path:
    """Write config.json, safetensors weights and tokenizer files for a random model; returns the dir."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) is not divisible by num_heads ({num_heads}); "
                             "pass head_dim")
        head_dim = hidden_size // num_heads
    torch_dtype = parse_dtype(dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = write_tokenizer(out, style="llama" if arch == "LlamaForCausalLM" else "qwen",
                          model_max_length=max_position_embeddings)
    tok_size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is None:
        vocab_size = -(-tok_size // 8) * 8  # padded like real checkpoints; extra rows are never produced
    elif vocab_size < tok_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok_size} tokens")

    config = _hf_config(
        arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, head_dim=head_dim,
        vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings, dtype_name=_DTYPE_NAMES[torch_dtype],
        bos_id=tok.token_to_id(BOS), eos_id=tok.token_to_id(EOS))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "do_sample": False})

    weights = _random_weights(
        arch, seed=seed, hidden=hidden_size, layers=num_layers, heads=num_heads, kv_heads=num_kv_heads,
        inter=intermediate_size, head_dim=head_dim, vocab=vocab_size, tied=tie_word_embeddings)
    weights = {k: v.to(torch_dtype).contiguous() for k, v in weights.items()}
    _save_weights(out, weights, shards)
    return out


def _hf_config(arch: str, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
               intermediate_size: int, head_dim: int, vocab_size: int, tie_word_embeddings: bool,
               rope_scaling: dict[str, Any] | None, max_position_embeddings: int, dtype_name: str,
               bos_id: int, eos_id: int) -> dict[str, Any]:
    is_llama = arch == "LlamaForCausalLM"
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[arch],
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5 if is_llama else 1e-6,
        "rope_theta": 500000.0 if is_llama else 1000000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype_name,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if is_llama:
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        # Qwen configs always spell out sliding-window fields; the window itself is off.
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
        if arch == "Qwen3ForCausalLM":
            config["attention_bias"] = False
    return config


def _random_weights(arch: str, *, seed: int, hidden: int, layers: int, heads: int, kv_heads: int,
                    inter: int, head_dim: int, vocab: int, tied: bool) -> dict[str, torch.Tensor]:
    """Weights named exactly as HF transformers names them, drawn in a fixed order from `seed`."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    def norm(size: int) -> torch.Tensor:
        # Not exactly 1: a skipped or misplaced norm must change the outputs.
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    def bias(size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen) * 0.02

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": matrix(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = matrix(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        if arch == "Qwen2ForCausalLM":
            w[p + "self_attn.q_proj.bias"] = bias(heads * head_dim)
            w[p + "self_attn.k_proj.bias"] = bias(kv_heads * head_dim)
            w[p + "self_attn.v_proj.bias"] = bias(kv_heads * head_dim)
        if arch == "Qwen3ForCausalLM":
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "self_attn.o_proj.weight"] = matrix(hidden, heads * head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
        w[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
        w[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
    w["model.norm.weight"] = norm(hidden)
    if not tied:
        w["lm_head.weight"] = matrix(vocab, hidden)
    return w


def _save_weights(out: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    names = list(weights)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be in [1, {len(names)}], got {shards}")
    metadata = {"format": "pt"}  # transformers expects this marker on torch-written files
    if shards == 1:
        save_file(weights, str(out / "model.safetensors"), metadata=metadata)
        return
    # Contiguous runs of tensors per shard, split by count: layers span shard boundaries, as in
    # real checkpoints, so loaders cannot assume one file per layer.
    weight_map: dict[str, str] = {}
    for s in range(shards):
        part = names[s * len(names) // shards:(s + 1) * len(names) // shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, str(out / fname), metadata=metadata)
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")

