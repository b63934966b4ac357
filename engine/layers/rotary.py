"""Rotary position embeddings (neox layout, as HF Llama/Qwen), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.layers.dispatch import kernels_for


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between blended
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, blended, scaled).float()


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to packed q/k from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        if self.cos.device.type != "meta":
            self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the cos/sin table in float32 on the buffers' device (after meta init)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.cos.device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=self.cos.device)
        freqs = torch.outer(t, inv_freq)
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inplace: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (tokens, heads, dim), k: (tokens, kv_heads, dim).

        On CUDA one Triton launch rotates both (dispatch.py). `inplace` lets that kernel write
        back into q and k; callers must still use the returned tensors (torch never writes back).
        """
        ops = kernels_for(q, k) if q.dim() == 3 and k.dim() == 3 else None
        if ops is not None:
            return ops.rotary(positions, q, k, self.cos, self.sin, inplace=inplace)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
