"""Seeded uniform noise: a pure function of (seed, position, token, stream), the same on any device
and in any batch, which is what makes sampled tokens reproducible per request."""

from __future__ import annotations

import torch


def signed64(x: int) -> int:
    """A Python int wrapped to the signed int64 value with the same low 64 bits."""
    return ((x + 2**63) % 2**64) - 2**63


_GOLDEN = signed64(0x9E3779B97F4A7C15)  # splitmix64 increment
_MIX1 = signed64(0xBF58476D1CE4E5B9)
_MIX2 = signed64(0x94D049BB133111EB)
_POS_MUL = signed64(0xD6E8FEB86659FD93)
_STREAM_MUL = signed64(0xC2B2AE3D27D4EB4F)


def _srl_(z: torch.Tensor, s: int, out: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 `z` by `s` into `out` (torch's >> is arithmetic, so mask)."""
    torch.bitwise_right_shift(z, s, out=out)
    return out.bitwise_and_((1 << (64 - s)) - 1)


def _mix64_(z: torch.Tensor, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """splitmix64 finaliser applied in place to int64 `z` (multiplication wraps mod 2^64)."""
    t = torch.empty_like(z) if tmp is None else tmp
    z.bitwise_xor_(_srl_(z, 30, t)).mul_(_MIX1)
    z.bitwise_xor_(_srl_(z, 27, t)).mul_(_MIX2)
    return z.bitwise_xor_(_srl_(z, 31, t))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = 0) -> torch.Tensor:
    """(rows,) int64 seeds and positions -> (rows, vocab_size) float32 uniforms in the open (0, 1).

    Element [r, v] is a pure function of (seeds[r], positions[r], v, stream): a splitmix64 hash
    of a per-row key and the vocab counter, so it is the same on any device and in any batch.
    """
    seeds = seeds.to(torch.int64)
    key = seeds + signed64((stream + 1) * _STREAM_MUL)
    key = _mix64_(key)
    key = _mix64_(key.bitwise_xor_(positions.to(device=seeds.device, dtype=torch.int64) * _POS_MUL))
    idx = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64).mul_(_GOLDEN)
    z = key[:, None] + idx[None, :]
    tmp = torch.empty_like(z)
    _mix64_(z, tmp)
    bits = _srl_(z, 41, tmp)  # top 23 bits: (k + 0.5) / 2^23 is exact in float32 and < 1
    return bits.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


__all__ = ["signed64", "uniform_noise"]
