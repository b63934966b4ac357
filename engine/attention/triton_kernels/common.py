"""Launch settings shared by the attention kernels (tiles, dot precision, interpreter workarounds)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """A flash kernel's query and key tile sizes and launch settings."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests): kernels then run on numpy, slowly."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 activations get exact fp32 products (tf32 would drift from the torch oracle)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """The interpreter computes bf16/fp16 tl.dot wrongly (Triton 3.9); upcast the operands there.

    On a GPU the tensor cores take bf16/fp16 operands and accumulate in fp32.
    """
    return interpreting() and dtype != torch.float32
