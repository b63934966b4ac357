"""Chooses between the fused Triton kernels and the torch reference for the elementwise layers
and the skinny linears (the GEMV of engine/layers/gemv.py).

"auto" (default): Triton for CUDA tensors when it imports, torch otherwise, so CPU runs never
import Triton and stay the reference. "on" forces Triton (CPU tests under TRITON_INTERPRET=1);
"off" forces torch (debugging a GPU run against the reference).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import ModuleType
from typing import Iterator

import torch

MODES = ("auto", "on", "off")
_mode = "auto"


def set_fused_ops(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"fused ops mode must be one of {MODES}, got {mode!r}")
    _mode = mode


def fused_ops_mode() -> str:
    return _mode


@contextlib.contextmanager
def fused_ops(mode: str) -> Iterator[None]:
    """Temporarily set the mode (tests compare both paths on the same model)."""
    previous = _mode
    set_fused_ops(mode)
    try:
        yield
    finally:
        set_fused_ops(previous)


@functools.lru_cache(maxsize=None)
def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"engine.layers.{name}")
    except ImportError:
        return None


def _module_for(name: str, t: torch.Tensor, others: tuple[torch.Tensor, ...]) -> ModuleType | None:
    if _mode == "off" or (_mode == "auto" and not t.is_cuda):
        return None
    # the kernels have no backward: anything autograd must differentiate stays in torch (serving
    # runs under inference_mode, so this only catches training code reusing these layers)
    if torch.is_grad_enabled() and (t.requires_grad or any(o.requires_grad for o in others)):
        return None
    ops = _load(name)
    if ops is None and _mode == "on":
        raise RuntimeError("fused ops forced on but triton does not import")
    return ops


def kernels_for(t: torch.Tensor, *others: torch.Tensor) -> ModuleType | None:
    """The Triton kernel module when `t` (and `others`, e.g. a norm weight) should take the
    fused path, else None (use torch)."""
    return _module_for("triton_ops", t, others)


def gemv_for(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """The GEMV module when x @ weight^T is skinny enough for it (a few rows), else None."""
    ops = _module_for("gemv", x, (weight,))
    return ops if ops is not None and ops.supports(x, weight) else None


def relay_kernels_for(t: torch.Tensor) -> ModuleType | None:
    """The fused relay kernels of a captured decode step (relay_kernels.py), else None."""
    return _module_for("relay_kernels", t, ())
