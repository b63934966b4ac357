"""Programmatic dependent launch (Hopper+): a Triton kernel may start before the previous one ends.

Every kernel launched with `launch_pdl=True` calls `pdl_sync` before it reads anything an earlier
kernel wrote (and before it writes anything an earlier kernel reads): `gdc_wait` blocks until the
previous grid has finished and flushed its memory. Because every such kernel waits, completion
still chains through the stream even when a kernel lets its dependents start early. Work that does
not depend on earlier kernels (streaming a weight) may go before the wait, which is the point:
it overlaps the previous kernel's tail and the launch gap. Kernels launched without the attribute
(cuBLAS, torch ops) keep ordinary stream order.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _device_supports_pdl(index: int) -> bool:
    if os.environ.get("PDSERVE_PDL", "1") == "0":
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 9


def use_pdl(device: torch.device) -> bool:
    """True where launches should carry the PDL attribute: CUDA, compute capability >= 9, a
    Triton with grid-dependency control, and not switched off with PDSERVE_PDL=0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict[str, bool]:
    """Launch options for a kernel with a `USE_PDL` constexpr that calls `pdl_sync` first."""
    on = use_pdl(t.device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def pdl_sync(USE_PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch (no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
