"""The static side of captured forwards: graph keys, each graph's static buffers, the shared
input arena, and the copies in and out of them (engine/cuda_graph.py replays them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core import ForwardMode
from engine.forward_context import ForwardContext


@dataclass
class GraphStats:
    """Counters for tests and benchmarks: forwards served by an existing graph, graphs captured
    (at start-up or on a miss; the forward that triggered a capture counts here, not in hits),
    and forwards that ran eagerly, by reason."""

    hits: int = 0
    captures: int = 0
    eager: int = 0
    eager_reasons: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class GraphKey:
    mode: ForwardMode
    tokens_per_req: int
    batch_size: int  # padded
    tree_width: int | None
    aux_hidden_layers: tuple[int, ...]
    inputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # name, trailing shape, dtype
    # the pool, request table and backend a graph bakes in (alive as long as the graph is)
    targets: tuple[int, int, int]
    # a prompt graph (engine/prompt_graphs.py): tokens_per_req is then its token bucket
    ragged: bool = False
    # a mixed graph (engine/mixed_graphs.py): its decode rows bucket (tokens_per_req: the chunk's)
    decode_rows: int = 0


@dataclass
class GraphEntry:
    """Static inputs, static context and (when captured) the graph and its output tensors."""

    key: GraphKey
    input_ids: torch.Tensor
    ctx: ForwardContext
    model_inputs: dict[str, torch.Tensor]
    pad_seq_len: int
    pad_mask: torch.Tensor | None  # (tokens_per_req, W) mask of a padded request
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    output: Any = None


class InputArena:
    """One flat buffer per (input name, dtype); each graph views a contiguous prefix of it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < numel:
            # graphs captured on the old buffer keep it alive through their views; doubling
            # bounds that waste (pre-capturing the largest batch first avoids it altogether)
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = torch.zeros(size, dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buf
        return buf[:numel].view(shape)


def slice_rows(out: Any, n: int) -> Any:
    """The real rows of a (possibly nested) output, cloned: the next replay overwrites them."""
    if isinstance(out, torch.Tensor):
        return out[:n].clone()
    if isinstance(out, (tuple, list)):
        return type(out)(slice_rows(o, n) for o in out)
    return out


def gather_rows(out: Any, rows: torch.Tensor) -> Any:
    """`rows` of a (possibly nested) output, copied: the next replay overwrites the output."""
    if isinstance(out, torch.Tensor):
        return out.index_select(0, rows)
    if isinstance(out, (tuple, list)):
        return type(out)(gather_rows(o, rows) for o in out)
    return out


def input_signature(inputs: dict[str, torch.Tensor]) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    return tuple(sorted((k, tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()))


def copy_padded(dst: torch.Tensor, src: torch.Tensor, n: int, fill: int | float) -> None:
    dst[:n].copy_(src)
    dst[n:].fill_(fill)
