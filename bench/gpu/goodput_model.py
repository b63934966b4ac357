"""The goodput benchmark's checkpoint: Llama-3.1-8B's shape with the built-in tokenizer's 4,096-token
vocabulary and random bf16 weights, written as an HF directory that `pdserve up --model` loads.

Only one decoder layer's weights are drawn; all 32 layers get a copy of them (one shard file per
layer, written from the same tensors). The compute and the bytes read per step are the 8B model's,
and drawing 7B normal numbers on the host would cost more than writing the files. The built-in
tokenizer's vocabulary keeps prompts of token ids valid for the router, which checks them against
the tokenizer. A directory already holding this checkpoint (its marker file matches) is reused;
one holding anything else is never written over.

The weights make greedy decoding predictable, as a trained model's mostly is: residual branches
are scaled down and embeddings up, so the last hidden state stays near the current token's
embedding, and lm_head's rows are a permutation of the embeddings, so the next token is a fixed
function of the current one, won by a wide margin (bench/gpu/synthetic.widen_margins does the same
in memory). A draft head that applies the same function (fixtures/tiny_eagle.py, `mode="echo"`)
is right at nearly every position, so speculation does real work. The special tokens' rows are
zero: no output ends at an end-of-sequence token. Compute and bytes read are the 8B model's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.gpu.llama8b import LLAMA_8B
from pdserve.models import BUILTIN_TARGET

MARKER = "goodput_checkpoint.json"
STD = 0.02
EMBEDDING_SCALE = 5.0
# every layer holds the same weights, so the residual branches add up coherently over 32 layers:
# scaled to about 8% of the embedding's norm in all
RESIDUAL_SCALE = 1e-4
SPECIAL_IDS = range(6)  # the built-in tokenizer's added tokens: <|bos|> .. <|assistant|>


def llama8b_config(**shape: Any) -> dict[str, Any]:
    """LLAMA_8B with the built-in tokenizer's vocabulary and special-token ids (and `shape`'s
    overrides: a smaller body for tests)."""
    builtin = json.loads((BUILTIN_TARGET / "config.json").read_text())
    ids = {k: builtin[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    return {**LLAMA_8B, **ids, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, **shape}


def write_llama8b_dir(path: Path, seed: int = 0, **shape: Any) -> Path:
    """Write (or reuse) the checkpoint in `path`; returns `path`."""
    config = llama8b_config(**shape)
    marker = {"config": config, "seed": seed, "std": STD, "predictable": [EMBEDDING_SCALE, RESIDUAL_SCALE]}
    if (path / MARKER).is_file():
        if json.loads((path / MARKER).read_text()) == marker:
            return path
        shutil.rmtree(path)  # an older one of ours: only a directory with our marker is replaced
    elif path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} holds something other than this benchmark's checkpoint")
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, config["max_position_embeddings"])
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    layer = _layer_weights(config, gen)
    weight_map: dict[str, str] = {}
    total = 0
    n_layers = config["num_hidden_layers"]
    for i in range(n_layers):
        shard = f"model-{i + 1:05d}-of-{n_layers + 1:05d}.safetensors"
        named = {f"model.layers.{i}.{name}": t for name, t in layer.items()}
        save_file(named, str(path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(named, shard))
        total += sum(t.numel() * t.element_size() for t in named.values())
    outer = _outer_weights(config, gen)
    shard = f"model-{n_layers + 1:05d}-of-{n_layers + 1:05d}.safetensors"
    save_file(outer, str(path / shard), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(outer, shard))
    total += sum(t.numel() * t.element_size() for t in outer.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (path / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last: a cut-short write is redone
    return path


def write_tokenizer(path: Path, max_len: int) -> None:
    """The built-in tokenizer in `path`, its length cap raised to `max_len`."""
    shutil.copy(BUILTIN_TARGET / "tokenizer.json", path / "tokenizer.json")
    tok_config = json.loads((BUILTIN_TARGET / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = max_len  # the built-in model's 1,024 would cap prompts
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def _normal(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * (STD * scale)).to(torch.bfloat16)


def _layer_weights(c: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    ones = torch.ones(h, dtype=torch.bfloat16)
    return {
        "input_layernorm.weight": ones,
        "post_attention_layernorm.weight": ones.clone(),  # one file may not hold a tensor twice
        "self_attn.q_proj.weight": _normal(gen, q, h),
        "self_attn.k_proj.weight": _normal(gen, kv, h),
        "self_attn.v_proj.weight": _normal(gen, kv, h),
        "self_attn.o_proj.weight": _normal(gen, h, q, scale=RESIDUAL_SCALE),
        "mlp.gate_proj.weight": _normal(gen, inter, h),
        "mlp.up_proj.weight": _normal(gen, inter, h),
        "mlp.down_proj.weight": _normal(gen, h, inter, scale=RESIDUAL_SCALE),
    }


def _outer_weights(c: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, vocab = c["hidden_size"], c["vocab_size"]
    emb = _normal(gen, vocab, h, scale=EMBEDDING_SCALE)
    out = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not c["tie_word_embeddings"]:
        head = emb[torch.randperm(vocab, generator=gen)]  # the next token: a permutation of the current
        head[list(SPECIAL_IDS)] = 0  # never the argmax: outputs run to their length
        out["lm_head.weight"] = head
    return out
