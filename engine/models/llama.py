"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3 dense) with HF parameter names.

One class covers the family: Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm.
Every forward takes an explicit ForwardContext; attention goes through its backend. Under tensor
parallelism (a TpGroup of several ranks) each rank builds its share: its heads and KV heads
(common/tp_layout.py), its MLP columns, its vocabulary block; the attention and MLP outputs are
summed over ranks (row-parallel o_proj and down_proj), so every rank holds the full hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_context import ForwardContext
from engine.layers.activation import silu_and_mul
from engine.layers.linear import MergedLinear, apply_linear, project
from engine.layers.norm import RMSNorm, add_norm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from engine.parallel.group import SINGLE, TpGroup


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        layout = tp.layout(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)
        self.num_heads, self.num_kv_heads = len(layout.heads), len(layout.kv_heads)
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        d_in = input_size or cfg.hidden_size  # EAGLE-3 attends over [embedding, hidden] (2x wide)
        self.q_proj = nn.Linear(d_in, self.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5
        self._qkv: MergedLinear | None = None

    def fuse_projections(self) -> None:
        """q/k/v as one GEMM from now on (call after loading; parameter names stay)."""
        self._qkv = MergedLinear([self.q_proj, self.k_proj, self.v_proj])

    def _qkv_rotated(
        self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q, k, v = project(self._qkv, [self.q_proj, self.k_proj, self.v_proj], x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(ctx.positions, q, k)
        return q, k, v

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self._qkv_rotated(x, rotary, ctx)
        out = ctx.attn_backend.forward(q, k, v, self.layer_id, self.scale, ctx)
        return self.tp.all_reduce(apply_linear(self.o_proj, out.reshape(x.shape[0], -1)))

    def write_kv(self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> None:
        """Only this layer's cache entries for `x`: the same projections and rotation as
        `forward` (so the same K/V), no attention, no output projection."""
        _, k, v = self._qkv_rotated(x, rotary, ctx)
        ctx.attn_backend.store(k, v, self.layer_id, ctx)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        intermediate //= tp.size  # TpLayout checked that it divides
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._gate_up: MergedLinear | None = None

    def fuse_projections(self) -> None:
        """gate/up as one GEMM from now on (call after loading; parameter names stay)."""
        self._gate_up = MergedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self._gate_up, [self.gate_proj, self.up_proj], x)
        return self.tp.all_reduce(apply_linear(self.down_proj, silu_and_mul(gate, up)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, input_norm: bool = True, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, tp=tp)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        # EAGLE-1 heads ship their single layer without an input norm
        self.input_layernorm: nn.Module = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        ctx: ForwardContext,
        capture: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, residual) with the residual add deferred to the next norm
        (each add runs inside the following norm's fused kernel on CUDA). `capture` gets the
        layer's input state (x + residual), which that fused kernel computes anyway."""
        h, residual = add_norm(self.input_layernorm, x, residual)
        if capture is not None:
            capture.append(residual)
        h = self.self_attn(h, rotary, ctx)
        h, residual = add_norm(self.post_attention_layernorm, h, residual)
        return self.mlp(h), residual

    def write_kv(self, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> None:
        """The cache entries `forward(x, None, ...)` would write, and nothing else."""
        self.self_attn.write_kv(add_norm(self.input_layernorm, x, None)[0], rotary, ctx)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp=tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, input_embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states and the inputs of `ctx.aux_hidden_layers`."""
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual: torch.Tensor | None = None
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, self.rotary, ctx, captured if i in ctx.aux_hidden_layers else None)
        by_layer = dict(zip(sorted(ctx.aux_hidden_layers), captured))
        return add_norm(self.norm, x, residual)[0], [by_layer[i] for i in ctx.aux_hidden_layers]


class LlamaForCausalLM(nn.Module):
    """Target model: hidden states out of `forward`, logits from `compute_logits`."""

    def __init__(self, cfg: ModelConfig, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = LlamaModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def tied_parameter_names(self) -> set[str]:
        """Names a checkpoint may omit because they alias another parameter."""
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()


def fuse_projections(model: nn.Module) -> int:
    """Merge q/k/v and gate/up of every layer (targets and EAGLE heads alike) into single GEMMs,
    after the weights are loaded; returns how many layers' projections were merged."""
    merged = 0
    for module in model.modules():
        if isinstance(module, (LlamaAttention, LlamaMLP)):
            module.fuse_projections()
            merged += 1
    return merged
