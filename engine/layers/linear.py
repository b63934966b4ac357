"""Merging sibling projections (q/k/v, gate/up) into one GEMM while keeping their parameters.

A merged weight is one tensor; each original nn.Linear's parameter becomes a view of its rows,
so checkpoint names, `load_weights` (which copies into the parameters) and `state_dict` keep
working unchanged and no weight is held twice. Anything that re-allocates the parameters
afterwards (`.to()`, assigning new data) breaks the views; `MergedLinear.usable` notices and the
callers fall back to one GEMM per projection until merged again.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.layers.dispatch import gemv_for


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the Triton GEMV on CUDA for the few-row products of decode and verify."""
    ops = gemv_for(x, weight)
    if ops is not None:
        return ops.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def apply_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An nn.Linear's forward through `linear` (modules keep their names and parameters)."""
    return linear(x, layer.weight, layer.bias)


class MergedLinear:
    """One weight (and bias) for several nn.Linear modules over the same input."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in self.linears]
        has_bias = [lin.bias is not None for lin in self.linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("cannot merge projections where only some have a bias")
        # outside inference mode: the parameters must stay writable by later loads
        with torch.inference_mode(False), torch.no_grad():
            self.weight = self._merge([lin.weight for lin in self.linears])
            self.bias = self._merge([lin.bias for lin in self.linears]) if all(has_bias) else None
        self._ptrs = [lin.weight.data_ptr() for lin in self.linears]

    @staticmethod
    def _merge(params: list[torch.Tensor]) -> torch.Tensor:
        merged = torch.cat([p.detach() for p in params])
        for p, view in zip(params, merged.split([p.shape[0] for p in params])):
            p.data = view
        return merged

    def usable(self) -> bool:
        """Still backed by the merged tensors, and no autograd needs the separate parameters."""
        if any(lin.weight.data_ptr() != ptr for lin, ptr in zip(self.linears, self._ptrs)):
            return False
        return not (torch.is_grad_enabled() and self.linears[0].weight.requires_grad)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def project(merged: MergedLinear | None, linears: list[nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """Each linear's output: column views of one merged GEMM when possible, else one GEMM each."""
    if merged is not None and merged.usable():
        return list(merged(x).split(merged.sizes, dim=-1))
    return [apply_linear(lin, x) for lin in linears]
