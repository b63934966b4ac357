"""Checkpoints written by transformers itself (the oracle for names, shapes and numerics)."""

from __future__ import annotations

from pathlib import Path

import torch

HF_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def write_hf_model(path: Path, kind: str, seed: int = 0, vocab_size: int = 300) -> Path:
    import transformers

    cfg_name, model_name, extra = HF_ARCHS[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        eos_token_id=vocab_size - 1,
        bos_token_id=0,
        **extra,
    )
    model = getattr(transformers, model_name)(cfg).to(torch.float32)
    with torch.no_grad():  # HF initialises norms to exactly 1; perturb so a skipped norm shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return path
