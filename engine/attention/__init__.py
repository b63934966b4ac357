"""Attention backends over the paged KV cache: the torch reference and (on GPU) Triton."""

from engine.attention.base import AttentionBackend, create_attention_backend

__all__ = ["AttentionBackend", "create_attention_backend"]
