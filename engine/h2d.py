"""Host-to-device copies of small index lists that never stall the stream.

A copy from pageable host memory waits for the device stream to drain, which would undo overlap
scheduling (the CPU preparing batch N+1 while batch N runs). Staging through pinned memory lets the
copy queue behind the forward in flight; torch's pinned allocator keeps the staging buffer alive
until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values: list[int] | list[list[int]] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """int64 values (a list, a list of equal-length lists, or a CPU tensor) on `device`."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    if host.device.type != "cpu":  # already on a device: nothing to stage
        return host.to(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
