"""Model architectures, looked up by the `architectures` name of an HF config."""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig, ModelLoadError
from engine.models.llama import LlamaForCausalLM

# Qwen2/Qwen3 dense are Llama with biases / qk-norm, switched on by ModelConfig fields.
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return MODEL_CLASSES[cfg.architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported architecture {cfg.architecture!r}") from None
