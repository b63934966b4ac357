"""Every CUDA graph this process captured, by device, so they can all be released at once.

NCCL counts the graphs that captured a communicator's collectives, and neither destroying nor
aborting that communicator completes while one of them lives (pytorch#115388): a tensor-parallel
rank leaving its group (engine/parallel/group.py) releases its device's graphs first. A process
runs one engine per device at a time, so the device's graphs are that engine's.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch

_CAPTURED: defaultdict[int, weakref.WeakSet[torch.cuda.CUDAGraph]] = defaultdict(weakref.WeakSet)


def new_graph(device: torch.device | int | None = None) -> torch.cuda.CUDAGraph:
    """An empty graph, to capture on `device` (default: the current one), tracked until released."""
    graph = torch.cuda.CUDAGraph()
    _CAPTURED[_index(device)].add(graph)
    return graph


def release_graphs_on(device: torch.device) -> int:
    """Free every tracked graph of `device` (replaying one afterwards fails); returns how many."""
    if device.type != "cuda":
        return 0
    graphs = list(_CAPTURED.pop(_index(device), ()))
    for graph in graphs:
        graph.reset()
    return len(graphs)


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index
