"""EAGLE draft heads in their published formats, sharing the target's embedding and LM head.

EAGLE-1/2: `fc` over [token embedding, feature] then one Llama decoder layer (EAGLE-1 ships it
without an input norm); logits from the target's LM head on the layer output. The feature is the
target's final hidden state after prefill/verify, and the head's own output in later draft steps.

EAGLE-3: the feature fed from the target is its low/mid/high layer states concatenated (3x
wide) and squeezed by `fc`; the decoder layer (`midlayer`) attends over [norm(embedding),
norm(feature)] (2x wide); its own `norm` + `lm_head` over a smaller draft vocabulary, mapped to
target ids through `d2t` (target id = draft id + d2t[draft id]).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_context import ForwardContext
from engine.layers.linear import apply_linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "LlamaForCausalLM")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class _DraftHead(nn.Module):
    """What every draft head does with its target: borrow its embedding (unless the checkpoint
    ships one) and, for EAGLE-1/2, its LM head. The target is held outside the module tree so
    its weights are neither registered twice nor loaded from the head's checkpoint."""

    _target: list[nn.Module]

    def attach_target(self, target: nn.Module) -> None:
        self._target = [target]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = getattr(self, "embed_tokens", None)
        return emb(ids) if emb is not None else self._target[0].embed(ids)


class EagleHead(_DraftHead):
    """EAGLE-1/2 draft model."""

    def __init__(self, cfg: ModelConfig, *, fc_bias: bool, input_norm: bool, own_embedding: bool) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, 0, input_norm=input_norm)])
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self._target = []

    feature_size_from_target = property(lambda self: self.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, features: torch.Tensor) -> torch.Tensor:
        out, residual = self.layers[0](self._fc(input_ids, features), None, self.rotary, ctx)
        return out + residual

    def write_kv(self, input_ids: torch.Tensor, ctx: ForwardContext, features: torch.Tensor) -> None:
        """The head's cache entries for these tokens, without attention or MLP."""
        self.layers[0].write_kv(self._fc(input_ids, features), self.rotary, ctx)

    def _fc(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        inputs = torch.cat((self._embed(input_ids), features.to(self.fc.weight.dtype)), dim=-1)
        return apply_linear(self.fc, inputs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, 0, input_size=2 * cfg.hidden_size)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, emb: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        h = self.self_attn(self._attn_input(emb, hidden), rotary, ctx) + hidden
        return self.mlp(self.post_attention_layernorm(h)) + h

    def write_kv(self, emb: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext) -> None:
        self.self_attn.write_kv(self._attn_input(emb, hidden), rotary, ctx)

    def _attn_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)


class Eagle3Head(_DraftHead):
    """EAGLE-3 draft model."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        target_hidden_size: int,
        draft_vocab_size: int,
        target_vocab_size: int,
        own_embedding: bool,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.target_hidden_size = target_hidden_size
        self.fc = nn.Linear(3 * target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(target_vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self._target = []

    feature_size_from_target = property(lambda self: 3 * self.target_hidden_size)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, features: torch.Tensor) -> torch.Tensor:
        hidden = self._hidden(features)
        return self.midlayer(self._embed(input_ids).to(hidden.dtype), hidden, self.rotary, ctx)

    def write_kv(self, input_ids: torch.Tensor, ctx: ForwardContext, features: torch.Tensor) -> None:
        """The head's cache entries for these tokens, without attention or MLP."""
        hidden = self._hidden(features)
        self.midlayer.write_kv(self._embed(input_ids).to(hidden.dtype), hidden, self.rotary, ctx)

    def _hidden(self, features: torch.Tensor) -> torch.Tensor:
        features = features.to(self.fc.weight.dtype)
        # target features arrive 3x wide; the head's own outputs (later draft steps) are not
        return apply_linear(self.fc, features) if features.shape[-1] == self.fc.in_features else features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return apply_linear(self.lm_head, self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def eagle3_aux_layers(num_target_layers: int, configured: list[int] | None = None) -> tuple[int, ...]:
    """Target layers whose *input* states feed EAGLE-3 (low, mid, high).

    A config's `eagle_aux_hidden_state_layer_ids` names layers whose *output* is wanted, which
    is the input of the next layer; without one, the inputs of layers 2, n/2 and n-3 are used.
    """
    n = num_target_layers
    wanted = [int(i) + 1 for i in configured] if configured else [2, n // 2, n - 3]
    return tuple(min(max(i, 0), n - 1) for i in wanted)
