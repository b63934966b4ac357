"""CUDA graphs for fixed-shape forwards: one graph per (shape key, padded batch size), replayed.

A forward is graphable when every request has the same number of query tokens (DECODE,
TARGET_VERIFY, the EAGLE draft steps, DRAFT_EXTEND over a constant window). Its batch is padded
up to the smallest captured batch size; padded rows are harmless by construction: they use
request row 0 and token slot 0 (page 0), both reserved for padding by engine/kv_cache.py, so
their K/V writes and reads stay on page 0, and their outputs are sliced away.

Each graph owns static copies of the context tensors (small), while model inputs such as draft
features (large) live in one arena per input name shared by all graphs: graphs run one after the
other and every input is copied in right before a replay, so sharing is safe.

Prompt batches (ragged lengths) are served by bucketed prompt graphs: see engine/prompt_graphs.py;
mixed batches (decode rows and a prompt chunk) by bucketed mixed graphs: engine/mixed_graphs.py.

The same padded static-buffer path also runs without capturing ("padded eager"), which is how
the padding logic is tested on CPU with the torch reference backend.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import logging
from typing import Any, Callable

import torch

from engine.core import ForwardMode
from engine.forward_context import ForwardContext
from engine.graph_buffers import (
    GraphEntry,
    GraphKey,
    GraphStats,
    InputArena,
    copy_padded,
    gather_rows,
    input_signature,
    slice_rows,
)
from engine.graph_fit import GRAPH_MODES, fixed_key, fixed_unfit, ragged_key
from engine.graph_registry import new_graph
from engine.mixed_graphs import (
    CHUNK_ROWS,
    MixedBuckets,
    live_rows,
    load_mixed_context,
    mixed_unfit,
    place_tokens,
    static_mixed_context,
)
from engine.prompt_graphs import PROMPT_MODES, PromptBuckets, load_prompt_context, prompt_unfit, static_prompt_context

logger = logging.getLogger(__name__)

# Runs before a capture, outside it: lazy initialisation (cuBLAS handles, Triton compilation and
# autotuning) must not happen while a graph is being recorded.
WARMUP_RUNS = 2

ForwardFn = Callable[[torch.Tensor, ForwardContext, dict[str, torch.Tensor]], Any]


def default_batch_sizes(max_bs: int) -> list[int]:
    """Dense where batches are common and padding is relatively costly, sparser further up."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, 257, 16)) + list(range(288, max_bs + 1, 32))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def graph_unsupported_reason(device: torch.device, backend: Any) -> str | None:
    """Why forwards on this device/backend cannot be captured (None when they can)."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if not getattr(backend, "graph_safe", False):
        return f"attention backend {getattr(backend, 'name', type(backend).__name__)!r} is not graph-safe"
    return None


class CudaGraphRunner:
    """Serves fixed-shape forwards from captured graphs (or padded eager when `capture=False`)."""

    def __init__(
        self,
        forward_fn: ForwardFn,
        device: torch.device,
        max_bs: int,
        batch_sizes: list[int] | None = None,
        *,
        capture: bool = True,
        max_tokens_per_req: int = 64,
        max_graphs: int = 512,
        prompt_buckets: PromptBuckets | None = None,
        mixed_buckets: MixedBuckets | None = None,
    ) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        sizes = sorted({b for b in (batch_sizes or default_batch_sizes(max_bs)) if 1 <= b <= max_bs})
        if not sizes:
            raise ValueError(f"no batch size in {batch_sizes} is within [1, {max_bs}]")
        self.forward_fn, self.device = forward_fn, device
        self.batch_sizes = sizes
        self.use_graphs = capture
        self.max_tokens_per_req, self.max_graphs = max_tokens_per_req, max_graphs
        self.prompt_buckets = prompt_buckets  # None: prompt forwards run eagerly
        self.mixed_buckets = mixed_buckets  # None: mixed batches run eagerly (or as prompt batches)
        self.stats = GraphStats()
        self.frozen = False  # after start-up capture: a miss runs eagerly instead of capturing
        self._graphs: dict[GraphKey, GraphEntry] = {}
        self._arena = InputArena(device)
        self._pool: Any = None  # one memory pool shared by all graphs of this runner
        self._stream: Any = None

    @property
    def max_bs(self) -> int:
        return self.batch_sizes[-1]

    def shapes(self) -> list[tuple[ForwardMode, int, int]]:
        """(mode, tokens per request, padded batch size) of every graph held, for tests and
        benchmarks that count what was captured."""
        return sorted(((k.mode, k.tokens_per_req, k.batch_size) for k in self._graphs), key=str)

    def padded_batch_size(self, bs: int) -> int | None:
        i = bisect.bisect_left(self.batch_sizes, bs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    # ---- serving ----
    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, Any]) -> Any | None:
        """The forward's output through a graph, or None when the caller must run it eagerly."""
        key, why = self._choose(input_ids, ctx, model_inputs)
        if key is None:
            self.stats.eager += 1
            self.stats.eager_reasons[why] += 1
            return None
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._new_graph(key, ctx.kv_pool, ctx.req_to_token, ctx.attn_backend)
            self._load(entry, input_ids, ctx, model_inputs)
            self._capture(entry)
        else:
            self._load(entry, input_ids, ctx, model_inputs)
            self.stats.hits += 1
        out = self._replay(entry)
        if key.decode_rows:
            return gather_rows(out, live_rows(ctx.decode_rows, key.decode_rows, ctx.num_tokens, self.device))
        return slice_rows(out, ctx.num_tokens)

    def _choose(
        self, input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, Any]
    ) -> tuple[GraphKey | None, str]:
        """The graph to serve this forward (held, or capturable now), else why none: a mixed
        graph for a mixed batch, a fixed-width graph, then a prompt graph for a prompt batch."""
        if self.mixed_buckets is not None and ctx.decode_rows:
            key, why = self._mixed_key(input_ids, ctx, model_inputs)
            if key is not None:
                return key, ""
        why = fixed_unfit(input_ids, ctx, model_inputs, self.max_bs, self.use_graphs)
        if why is None and self.use_graphs:
            why = self._device_unfit(ctx)
        if why is None:
            padded = self.padded_batch_size(ctx.batch_size)
            assert padded is not None
            key = fixed_key(ctx, model_inputs, padded)
            if not (why := self._miss_reason(key)):
                return key, ""
        if self.prompt_buckets is not None and ctx.mode in PROMPT_MODES:
            pwhy = prompt_unfit(input_ids, ctx, model_inputs) or self._device_unfit(ctx)
            bucket = self.prompt_buckets.fit(ctx.num_tokens, ctx.batch_size)
            if pwhy is None and bucket is None:
                pwhy = "prompt batch larger than its buckets"
            if pwhy is None:
                assert bucket is not None
                pkey = ragged_key(ctx.mode, *bucket, ctx.aux_hidden_layers, model_inputs, ctx)
                if not (pwhy := self._miss_reason(pkey)):
                    return pkey, ""
            why = pwhy
        return None, why or "no graph"

    def _mixed_key(
        self, input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, Any]
    ) -> tuple[GraphKey | None, str]:
        assert self.mixed_buckets is not None
        why = mixed_unfit(input_ids, ctx, model_inputs) or self._device_unfit(ctx)
        d = ctx.decode_rows
        bucket = self.mixed_buckets.fit(d, ctx.num_tokens - d, ctx.batch_size - d)
        if why is None and bucket is None:
            why = "mixed batch larger than its buckets"
        if why is not None:
            return None, why
        assert bucket is not None
        key = ragged_key(ForwardMode.EXTEND, bucket[1], CHUNK_ROWS, (), {}, ctx, decode_rows=bucket[0])
        why = self._miss_reason(key)
        return (None, why) if why else (key, "")

    def _miss_reason(self, key: GraphKey) -> str:
        """Why a graph for `key` can be neither replayed nor captured now ("" when it can)."""
        if key in self._graphs:
            return ""
        if self.frozen:
            return "not captured at start-up"
        if len(self._graphs) >= self.max_graphs:
            return "graph limit reached"
        if not key.ragged and key.tokens_per_req > self.max_tokens_per_req:
            return "too many tokens per request"
        return ""

    def _device_unfit(self, ctx: ForwardContext) -> str | None:
        if self.use_graphs:
            return graph_unsupported_reason(ctx.positions.device, ctx.attn_backend)
        return None

    # ---- capture ----
    def precapture(
        self,
        mode: ForwardMode,
        tokens_per_req: int,
        batch_sizes: list[int] | None,
        tree_width: int | None,
        aux_hidden_layers: tuple[int, ...],
        example_inputs: dict[str, torch.Tensor],
        kv_pool: Any,
        req_to_token: torch.Tensor,
        attn_backend: Any,
    ) -> int:
        """Capture graphs whose every row is padding (writes land on page 0); returns how many
        were new. Largest first, so the arena and memory pool are sized once."""
        if mode not in GRAPH_MODES:
            raise ValueError(f"mode {mode.name} cannot be captured")
        sizes = batch_sizes or self.batch_sizes
        padded = sorted({p for b in sizes if (p := self.padded_batch_size(b)) is not None}, reverse=True)
        sig = input_signature(example_inputs)
        keys = [
            GraphKey(mode, tokens_per_req, pb, tree_width, tuple(aux_hidden_layers), sig, (0, 0, 0)) for pb in padded
        ]
        return self._capture_new(keys, kv_pool, req_to_token, attn_backend)

    def precapture_prompts(
        self,
        mode: ForwardMode,
        aux_hidden_layers: tuple[int, ...],
        example_inputs: dict[str, torch.Tensor],
        kv_pool: Any,
        req_to_token: torch.Tensor,
        attn_backend: Any,
    ) -> int:
        """Capture the prompt graphs of every bucket (none without buckets); returns how many
        were new."""
        if self.prompt_buckets is None:
            return 0
        sig = input_signature(example_inputs)
        keys = [
            GraphKey(mode, t, r, None, tuple(aux_hidden_layers), sig, (0, 0, 0), ragged=True)
            for t, r in self.prompt_buckets.shapes()
        ]
        return self._capture_new(keys, kv_pool, req_to_token, attn_backend)

    def precapture_mixed(self, kv_pool: Any, req_to_token: torch.Tensor, attn_backend: Any) -> int:
        """Capture the mixed graphs of every bucket (none without buckets); returns how many were new."""
        if self.mixed_buckets is None:
            return 0
        keys = [
            GraphKey(ForwardMode.EXTEND, t, CHUNK_ROWS, None, (), (), (0, 0, 0), ragged=True, decode_rows=d)
            for d, t in self.mixed_buckets.shapes()
        ]
        return self._capture_new(keys, kv_pool, req_to_token, attn_backend)

    def _capture_new(self, keys: list[GraphKey], kv_pool: Any, req_to_token: torch.Tensor, attn_backend: Any) -> int:
        """Capture the graphs of `keys` (their targets set here) not held yet; returns how many."""
        targets = (id(kv_pool), id(req_to_token), id(attn_backend))
        new = 0
        for key in keys:
            key = dataclasses.replace(key, targets=targets)
            if key not in self._graphs:
                self._capture(self._new_graph(key, kv_pool, req_to_token, attn_backend))
                new += 1
        return new

    def _new_graph(self, key: GraphKey, kv_pool: Any, req_to_token: torch.Tensor, attn_backend: Any) -> GraphEntry:
        """Static tensors of one graph, every row initialised as padding."""
        if key.ragged:
            return self._new_prompt_graph(key, kv_pool, req_to_token, attn_backend)
        tpr, pb, w, dev = key.tokens_per_req, key.batch_size, key.tree_width, self.device
        pn = pb * tpr
        # a padded request ends at max(tpr, W) so a tree window never starts before position 0
        pad_seq = max(tpr, w or 0)
        pad_mask = None
        tree_mask = None
        if w is not None:
            # a padded query sees only itself: query j sits at window column W - tpr + j
            pad_mask = torch.zeros(tpr, w, dtype=torch.bool, device=dev)
            pad_mask[torch.arange(tpr, device=dev), torch.arange(w - tpr, w, device=dev)] = True
            tree_mask = pad_mask.expand(pb, tpr, w).clone()
        ctx = ForwardContext(
            mode=key.mode,
            positions=torch.zeros(pn, dtype=torch.int64, device=dev),
            out_cache_loc=torch.zeros(pn, dtype=torch.int64, device=dev),
            req_slots=torch.zeros(pb, dtype=torch.int64, device=dev),
            seq_lens=torch.full((pb,), pad_seq, dtype=torch.int64, device=dev),
            extend_lens=torch.full((pb,), tpr, dtype=torch.int64, device=dev),
            qo_indptr=torch.arange(pb + 1, dtype=torch.int64, device=dev) * tpr,
            req_to_token=req_to_token,
            kv_pool=kv_pool,
            attn_backend=attn_backend,
            # replays cannot refresh CPU lists: give the backend an upper bound (padded eager
            # overwrites it with the live lengths on every call)
            seq_lens_cpu=[int(req_to_token.shape[1])] * pb,
            extend_lens_cpu=[tpr] * pb,
            tree_mask=tree_mask,
            aux_hidden_layers=key.aux_hidden_layers,
        )
        inputs = {name: self._arena.view(name, (pn, *shape), dtype).zero_() for name, shape, dtype in key.inputs}
        entry = GraphEntry(key, torch.zeros(pn, dtype=torch.int64, device=dev), ctx, inputs, pad_seq, pad_mask)
        self._graphs[key] = entry
        self.stats.captures += 1
        return entry

    def _new_prompt_graph(
        self, key: GraphKey, kv_pool: Any, req_to_token: torch.Tensor, attn_backend: Any
    ) -> GraphEntry:
        """A prompt graph's static tensors (or a mixed graph's, whose tokens follow its decode rows)."""
        tokens, rows = key.tokens_per_req, key.batch_size
        if key.decode_rows:
            tokens += key.decode_rows
            ctx = static_mixed_context(
                key.decode_rows, key.tokens_per_req, kv_pool, req_to_token, attn_backend, self.device
            )
        else:
            ctx = static_prompt_context(
                key.mode, tokens, rows, key.aux_hidden_layers, kv_pool, req_to_token, attn_backend, self.device
            )
        inputs = {name: self._arena.view(name, (tokens, *shape), dtype).zero_() for name, shape, dtype in key.inputs}
        entry = GraphEntry(key, torch.zeros(tokens, dtype=torch.int64, device=self.device), ctx, inputs, 0, None)
        self._graphs[key] = entry
        self.stats.captures += 1
        return entry

    def _capture(self, entry: GraphEntry) -> None:
        if not self.use_graphs:
            return
        fn = lambda: self.forward_fn(entry.input_ids, entry.ctx, entry.model_inputs)  # noqa: E731
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for _ in range(WARMUP_RUNS):
                fn()
        current.wait_stream(self._stream)
        graph = new_graph(self.device)
        # No garbage collection inside the capture: freeing an old pinned staging buffer there
        # queries an event, which invalidates the capture.
        gc_was_on = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            # thread-local: other threads of a server (I/O, transfers) may use CUDA meanwhile
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                entry.output = fn()
        finally:
            if gc_was_on:
                gc.enable()
        entry.graph = graph
        logger.debug("captured CUDA graph %s", entry.key)

    # ---- replay ----
    def _load(
        self, entry: GraphEntry, input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, torch.Tensor]
    ) -> None:
        """Copy the live batch into the static tensors and reset the padded rows."""
        s, n, b = entry.ctx, ctx.num_tokens, ctx.batch_size
        if entry.key.decode_rows:  # a mixed batch carries no model inputs (mixed_unfit)
            place_tokens(entry.input_ids, input_ids, ctx.decode_rows, entry.key.decode_rows)
            load_mixed_context(s, ctx, padded_eager=not self.use_graphs)
            return
        copy_padded(entry.input_ids, input_ids, n, 0)
        for name, value in model_inputs.items():
            copy_padded(entry.model_inputs[name], value, n, 0)
        if entry.key.ragged:
            load_prompt_context(s, ctx, padded_eager=not self.use_graphs)
            return
        copy_padded(s.positions, ctx.positions, n, 0)
        copy_padded(s.out_cache_loc, ctx.out_cache_loc, n, 0)
        copy_padded(s.req_slots, ctx.req_slots, b, 0)
        copy_padded(s.seq_lens, ctx.seq_lens, b, entry.pad_seq_len)
        # extend_lens / qo_indptr: constant per graph (uniform lengths were checked on the CPU)
        if s.tree_mask is not None and ctx.tree_mask is not None:
            s.tree_mask[:b].copy_(ctx.tree_mask)
            s.tree_mask[b:].copy_(entry.pad_mask)
        if not self.use_graphs:
            pad = entry.key.batch_size - b
            s.seq_lens_cpu = list(ctx.seq_lens_cpu) + [entry.pad_seq_len] * pad

    def _replay(self, entry: GraphEntry) -> Any:
        if entry.graph is None:
            return self.forward_fn(entry.input_ids, entry.ctx, entry.model_inputs)
        entry.graph.replay()
        return entry.output
