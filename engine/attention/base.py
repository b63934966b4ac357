"""The attention backend interface and the registry that picks one by name."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from engine.forward_context import ForwardContext


class AttentionBackend(ABC):
    """Stores new K/V into the paged pool and attends over each request's cached context."""

    name: str = "base"
    # True when prepare() and forward() never sync with the host nor allocate device-dependent
    # shapes, so a CUDA graph may capture them (graph runners check it)
    graph_safe: bool = False

    def prepare(self, ctx: "ForwardContext") -> None:  # noqa: B027 - optional hook, no-op default
        """Build per-forward metadata once (shared by all layers); default: nothing."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float, ctx: "ForwardContext"
    ) -> torch.Tensor:
        """q: (tokens, heads, dim); k, v: (tokens, kv_heads, dim). Returns (tokens, heads, dim)."""

    def store(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, ctx: "ForwardContext") -> None:
        """Write k, v (tokens, kv_heads, dim) at ctx.out_cache_loc without attending (a forward
        that only fills the cache); needs no prepare()."""
        ctx.kv_pool.store(layer_id, ctx.out_cache_loc, k, v)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}
# built-in backends register themselves when their module is imported; imported on first use so
# the engine imports (and runs the torch backend) on machines without triton
_BUILTIN_MODULES = {"torch": "engine.attention.torch_backend", "triton": "engine.attention.triton_backend"}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    if name in _BACKENDS:
        raise ValueError(f"attention backend {name!r} already registered")
    _BACKENDS[name] = factory


def create_attention_backend(name: str = "torch") -> AttentionBackend:
    if name not in _BACKENDS:
        _import_builtin(name)
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}") from None


def _import_builtin(name: str) -> None:
    module = _BUILTIN_MODULES.get(name, _BUILTIN_MODULES["torch"])
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != "triton":
            raise
        raise RuntimeError(
            f"attention backend {name!r} needs the triton package, which is not "
            "installed; use attention_backend='torch'"
        ) from e
