"""The attention backend interface and the registry that picks one by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from engine.forward_context import ForwardContext


class AttentionBackend(ABC):
    """Stores new K/V into the paged pool and attends over each request's cached context."""

    name: str = "base"

    def prepare(self, ctx: "ForwardContext") -> None:
        """Build per-forward metadata once (shared by all layers); default: nothing."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                scale: float, ctx: "ForwardContext") -> torch.Tensor:
        """q: (tokens, heads, dim); k, v: (tokens, kv_heads, dim). Returns (tokens, heads, dim)."""


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    if name in _BACKENDS:
        raise ValueError(f"attention backend {name!r} already registered")
    _BACKENDS[name] = factory


def create_attention_backend(name: str = "torch") -> AttentionBackend:
    if name not in _BACKENDS:
        # implementations register themselves on import; import the built-in ones lazily
        from engine.attention import torch_backend  # noqa: F401
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}") from None
