"""The registry of attention backends: each registers a factory under its name; pick one by name."""

from __future__ import annotations

import importlib
from typing import Callable

from engine.forward_context import AttentionBackend


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}
# built-in backends register themselves when their module is imported; imported on first use so
# the engine imports (and runs the torch backend) on machines without triton
_BUILTIN_MODULES = {
    "torch": "engine.attention.torch_backend",
    "triton": "engine.attention.triton_backend",
}


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


__all__ = ["AttentionBackend", "create_attention_backend", "register_backend"]
