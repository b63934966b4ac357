"""SiLU(gate) * up, the gated activation of the Llama MLP (one fused Triton kernel on CUDA)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.layers.dispatch import kernels_for


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up; with `up` None, `gate` is a fused (..., 2n) gate_up output: gate first."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    ops = kernels_for(gate, up) if gate.shape == up.shape and gate.dim() >= 1 else None
    if ops is not None:
        return ops.silu_and_mul(gate, up)
    return F.silu(gate) * up
