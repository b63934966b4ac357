"""Training-side Llama blocks with HF parameter names: attention over whole sequences here, norm and
MLP shared with the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# The engine's layers run the torch reference whenever autograd needs them, so training uses the
# very modules (and numerics) that serve the checkpoint.
from engine.layers.norm import RMSNorm
from engine.layers.rotary import rope_inv_freq
from engine.models.llama import LlamaMLP


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of a Llama decoder; also the fields of the HF config.json written for it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = 1024
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_tables(head_dim: int, positions: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (positions, head_dim // 2) in float32, the engine's table (neox layout)."""
    t = torch.arange(positions, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(head_dim, theta, None))
    return freqs.cos().to(device), freqs.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, tokens, dim); cos/sin: (tokens, dim // 2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q and k, and v, as (batch, heads, tokens, dim); kv heads repeated for GQA."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads  # kv head j serves query heads [j*rep, (j+1)*rep), as HF
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer; `input_norm=False` is the EAGLE-1 head's layer (no input norm)."""

    def __init__(self, s: LlamaShape, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = LlamaMLP(s.hidden, s.intermediate)
        self.input_layernorm: nn.Module = RMSNorm(s.hidden, s.rms_eps) if input_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


def init_weights(module: nn.Module, num_layers: int, gen: torch.Generator, std: float = 0.02) -> None:
    """GPT-2 style init from `gen` in parameter order: output projections scaled by depth."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                residual_out = name.endswith(("o_proj.weight", "down_proj.weight"))
                scale = std / (2 * num_layers) ** 0.5 if residual_out else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def hf_llama_config(
    s: LlamaShape, *, arch: str, bos_id: int, eos_id: int, pad_id: int, tied: bool, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """config.json for a checkpoint of shape `s`, as transformers and engine.config read it."""
    return {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "vocab_size": s.vocab,
        "max_position_embeddings": s.max_positions,
        "rms_norm_eps": s.rms_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
    }
