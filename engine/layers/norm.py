"""RMSNorm as in the Llama family (computed in float32, weight applied in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.dispatch import kernels_for


class RMSNorm(nn.Module):
    """Takes (tokens, dim) hidden states or (tokens, heads, dim) for per-head q/k norm (Qwen3).

    On CUDA each call is one fused Triton kernel (see dispatch.py); the torch code below is the
    reference both paths match.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels_for(x, self.weight) if x.dim() in (2, 3) else None
        if ops is not None:
            return ops.rmsnorm(x, self.weight, self.eps)[0]
        return self._torch(x)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm's kernel."""
        ops = kernels_for(x, residual, self.weight) if x.dim() == 2 and x.dtype == residual.dtype else None
        if ops is not None:
            out, new_residual = ops.rmsnorm(x, self.weight, self.eps, residual)
            return out, new_residual
        residual = x + residual
        return self._torch(residual), residual

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for any norm module, fused when it is an RMSNorm;
    a missing residual (first layer) means the residual starts as x itself."""
    if residual is None:
        return norm(x), x
    if isinstance(norm, RMSNorm):
        return norm.forward_add(x, residual)
    residual = x + residual  # e.g. nn.Identity: EAGLE-1 heads ship no input norm
    return norm(residual), residual
