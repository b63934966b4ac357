"""Whole decode steps as one CUDA graph per key (a padded batch size, and whatever else fixes a
step's shapes), or run uncaptured through the same padded buffers off CUDA.

Between separately launched kernels the host spends more time than a small model's GPU work on
the small ops around a forward (contexts, gathers, argmax, stash). A step body built only of
fixed-shape device ops (contexts from `ModelRunner.window_context`, inputs from the FutureMap)
can be captured whole; the host's part of a step is then copying the slot inputs and one replay.
Padding rows use request slot 0: FutureMap row 0 (kept at zero) and KV page 0 (reserved for
padding). Running the same body on the padded buffers without a capture is how "graphs equal
eager" is tested on a CPU.
"""

from __future__ import annotations

import bisect
import gc
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from engine.graph_registry import new_graph

Body = Callable[[], tuple[torch.Tensor, ...]]


@dataclass
class StepGraph:
    """One key's static inputs (padded batch on dim 0, zero for padding), body and outputs."""

    inputs: dict[str, torch.Tensor]
    body: Body
    outputs: tuple[torch.Tensor, ...] | None = None
    graph: Any = None  # torch.cuda.CUDAGraph once captured


class StepGraphs:
    """The step graphs of one executor, built at start-up; `run` replays one for a batch."""

    def __init__(
        self, batch_sizes: Sequence[int], *, capture: bool, after_warmup: Callable[[], None] = lambda: None
    ) -> None:
        self.batch_sizes = sorted(batch_sizes)
        self.capture = capture
        self._after_warmup = after_warmup  # undo what warm-up runs wrote (padding rows)
        self._graphs: dict[Hashable, StepGraph] = {}
        self._pool: Any = None
        self.hits = 0

    def padded(self, bs: int) -> int | None:
        """The smallest graph batch size holding `bs` requests, or None past the largest."""
        i = bisect.bisect_left(self.batch_sizes, bs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def keys(self) -> list[Hashable]:
        return list(self._graphs)

    def get(self, key: Hashable) -> StepGraph | None:
        return self._graphs.get(key)

    def add(self, key: Hashable, inputs: dict[str, torch.Tensor], body: Body) -> StepGraph:
        """Register (and on CUDA capture) the body of one key over its static inputs."""
        entry = StepGraph(inputs, body)
        self._graphs[key] = entry
        if self.capture:
            self._capture(entry)
        return entry

    def run(self, entry: StepGraph, n: int, values: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copy the first `n` rows of each input, zero the padding, replay (or run the body on
        the padded buffers); returns the outputs' first `n` rows (views: copy before reuse)."""
        for name, value in values.items():
            buf = entry.inputs[name]
            buf[:n].copy_(value, non_blocking=True)
            buf[n:].zero_()
        if entry.graph is not None:
            entry.graph.replay()
            outputs = entry.outputs
        else:
            with torch.inference_mode():
                outputs = entry.body()
        self.hits += 1
        assert outputs is not None
        return tuple(t[:n] for t in outputs)

    def _capture(self, entry: StepGraph) -> None:
        device = next(iter(entry.inputs.values())).device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        # inference mode as at serving time: no autograd records, the fused kernels' path
        with torch.inference_mode(), torch.cuda.stream(stream):  # warm-up outside the capture
            for _ in range(2):
                entry.body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = new_graph(device)
        gc_was_on = gc.isenabled()
        gc.collect()
        gc.disable()  # a collection mid-capture could free a tensor the graph still records into
        try:
            with (
                torch.inference_mode(),
                torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"),
            ):
                entry.outputs = entry.body()
        finally:
            if gc_was_on:
                gc.enable()
        entry.graph = graph
        self._after_warmup()
