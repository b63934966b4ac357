"""A Llama-3.1-8B-shaped model with random bf16 weights, as HF transformers and as the engine's model.

Both share one set of weights: the HF model is built on the device with its own random init and
the engine's model copies its state dict, so "same model" comparisons are exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.config import ModelConfig
from engine.loader import build_empty, merge_projections_on_gpu
from engine.models import model_class

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def shape_config(raw: dict[str, Any] | None = None, **overrides: Any) -> tuple[dict[str, Any], ModelConfig]:
    raw = dict(raw or LLAMA_8B, **overrides)
    return raw, ModelConfig.from_hf(raw)


def build_hf(raw: dict[str, Any], device: torch.device, seed: int = 0) -> nn.Module:
    """transformers' LlamaForCausalLM with its own random init, directly on the device in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def build_engine_model(
    cfg: ModelConfig, device: torch.device, weights_from: nn.Module | None = None, seed: int = 0
) -> nn.Module:
    """The engine's model of the same shape: weights copied from an HF model, or random."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: dry runs of the scripts
    model = build_empty(model_class(cfg), cfg, dtype, device)
    with torch.no_grad():
        if weights_from is not None:
            missing, unexpected = model.load_state_dict(weights_from.state_dict(), strict=False)
            real_missing = [m for m in missing if not m.endswith(("cos", "sin"))]
            if real_missing or unexpected:
                raise RuntimeError(f"weight names differ: missing {real_missing[:4]} unexpected {unexpected[:4]}")
        else:
            gen = torch.Generator(device=device).manual_seed(seed)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    merge_projections_on_gpu(model, device)  # as the engine's loader does on a GPU
    return model.eval()


def weight_read_bytes(model: nn.Module) -> int:
    """Bytes one decode step reads: every parameter except the embedding table (a row gather);
    a tied lm_head is read through the embedding, so it counts once."""
    seen: set[int] = set()
    total = 0
    embed = model.model.embed_tokens.weight
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p is embed and not name.startswith("lm_head"):
            continue
        total += p.numel() * p.element_size()
    if model.lm_head.weight is embed:  # tied: the head reads the table once
        total += embed.numel() * embed.element_size()
    return total


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters multiplied per token in the decoder layers (excludes embedding and lm_head)."""
    h, kvh, d, inter = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    attn = h * cfg.num_heads * d + 2 * h * kvh * d + cfg.num_heads * d * h
    return cfg.num_layers * (attn + 3 * h * inter)
