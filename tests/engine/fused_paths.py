"""Run a callable on the torch reference path and on the forced Triton path (tests of fused ops)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from engine.layers.dispatch import fused_ops


def both_paths(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """fn() with the torch path, then with the Triton path forced on (inference mode, as served:
    with autograd recording, dispatch keeps parameters' ops in torch)."""
    with torch.inference_mode():
        with fused_ops("off"):
            ref = fn()
        with fused_ops("on"):
            got = fn()
    return ref, got
