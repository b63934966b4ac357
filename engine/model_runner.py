"""Runs one model (target or draft) over the paged cache: builds the ForwardContext, calls forward."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.core import ForwardMode
from engine.cuda_graph import CudaGraphRunner, GraphStats, graph_unsupported_reason
from engine.forward_context import ForwardContext
from engine.h2d import to_device
from engine.kv_cache import MAX_DECODE_WINDOW, KVCacheManager, KVPool
from engine.mixed_graphs import MixedBuckets
from engine.prompt_graphs import PromptBuckets

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns a model and its KV pool; the request table and page ids come from the shared manager.

    A draft model's runner runs TARGET_VERIFY forwards (fixed-width windows, in that mode's shape
    and graphs) only when its algorithm says it may (`supports_target_verify_for_draft`); asked
    otherwise, it refuses with an error naming why."""

    def __init__(
        self,
        model: nn.Module,
        kv: KVCacheManager,
        pool: KVPool,
        attn_backend: AttentionBackend,
        device: torch.device | str,
        *,
        target_verify: bool | str = True,
    ) -> None:
        self.model, self.kv, self.pool = model, kv, pool
        self.attn_backend = attn_backend
        self.device = torch.device(device)
        self.graphs: CudaGraphRunner | None = None  # set by enable_cuda_graphs
        # True, or the reason this (draft) runner may not run TARGET_VERIFY forwards
        self._target_verify = target_verify
        # positions past the model's table only occur in steps whose results are discarded (a
        # request that finished while the next step was in flight): clamp them, never index out
        self.max_position = int(model.config.max_position_embeddings) - 1 if model is not None else None
        self._constants: dict[tuple[str, int, int], torch.Tensor] = {}

    def check_mode(self, mode: ForwardMode) -> None:
        if mode is ForwardMode.TARGET_VERIFY and self._target_verify is not True:
            raise ValueError(f"this model runner cannot run TARGET_VERIFY forwards: {self._target_verify}")

    # ---- CUDA graphs ----
    def enable_cuda_graphs(
        self,
        max_bs: int,
        batch_sizes: list[int] | None = None,
        *,
        capture: bool = True,
        max_tokens_per_req: int = MAX_DECODE_WINDOW,
        prompt_tokens: int = 0,
        mixed_chunk_tokens: int = 0,
    ) -> bool:
        """Serve fixed-shape forwards of up to `max_bs` requests from CUDA graphs (see
        engine/cuda_graph.py), prompt batches of up to `prompt_tokens` tokens from bucketed
        prompt graphs (engine/prompt_graphs.py; 0: none), and mixed batches of up to `max_bs`
        decode rows and a chunk of up to `mixed_chunk_tokens` (engine/mixed_graphs.py; 0: none).
        `capture=False` runs the same padded static-buffer paths eagerly (any device or backend:
        the CPU test path). Returns whether it was enabled."""
        if capture and (why := graph_unsupported_reason(self.device, self.attn_backend)):
            logger.info("CUDA graphs stay off: %s", why)
            return False
        self.graphs = CudaGraphRunner(
            self._forward_eager,
            self.device,
            max_bs,
            batch_sizes,
            capture=capture,
            max_tokens_per_req=max_tokens_per_req,
            prompt_buckets=PromptBuckets.up_to(prompt_tokens, max_bs),
            mixed_buckets=MixedBuckets.up_to(mixed_chunk_tokens, max_bs) if mixed_chunk_tokens else None,
        )
        return True

    def disable_cuda_graphs(self) -> None:
        self.graphs = None

    def freeze_graphs(self) -> None:
        """No capture after this: shapes that were not pre-captured run eagerly."""
        if self.graphs is not None:
            self.graphs.frozen = True

    @torch.inference_mode()
    def capture(
        self,
        mode: ForwardMode,
        tokens_per_req: int,
        batch_sizes: list[int] | None = None,
        *,
        tree_width: int | None = None,
        aux_hidden_layers: tuple[int, ...] = (),
        **example_model_inputs: torch.Tensor,
    ) -> int:
        """Pre-capture (at start-up) the graphs of one forward shape so first requests do not pay
        for it. Model inputs are examples: only their trailing shape and dtype matter. Returns
        the number of new graphs (0 when graphs are off)."""
        self.check_mode(mode)
        if self.graphs is None:
            return 0
        return self.graphs.precapture(
            mode,
            tokens_per_req,
            batch_sizes,
            tree_width,
            aux_hidden_layers,
            example_model_inputs,
            self.pool,
            self.kv.req_to_token,
            self.attn_backend,
        )

    @torch.inference_mode()
    def capture_prompts(
        self, mode: ForwardMode, *, aux_hidden_layers: tuple[int, ...] = (), **example_model_inputs: torch.Tensor
    ) -> int:
        """Pre-capture the prompt graphs of every bucket for this forward (EXTEND, or the draft's
        DRAFT_EXTEND over a prompt). Returns the number of new graphs (0 when off)."""
        if self.graphs is None:
            return 0
        return self.graphs.precapture_prompts(
            mode, aux_hidden_layers, example_model_inputs, self.pool, self.kv.req_to_token, self.attn_backend
        )

    @torch.inference_mode()
    def capture_mixed(self) -> int:
        """Pre-capture the mixed graphs (decode rows beside a prompt chunk) of every bucket.
        Returns the number of new graphs (0 when off)."""
        if self.graphs is None:
            return 0
        return self.graphs.precapture_mixed(self.pool, self.kv.req_to_token, self.attn_backend)

    def graph_shapes(self) -> list[tuple[ForwardMode, int, int]]:
        """(mode, tokens per request, padded batch size) of the graphs held (none when off)."""
        return self.graphs.shapes() if self.graphs is not None else []

    @property
    def graph_stats(self) -> GraphStats:
        return self.graphs.stats if self.graphs is not None else GraphStats()

    def make_context(
        self,
        mode: ForwardMode,
        slots: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        aux_hidden_layers: tuple[int, ...] = (),
        device_prefix: torch.Tensor | None = None,
        decode_rows: int = 0,
    ) -> ForwardContext:
        """Request i writes tokens [prefix_lens[i], prefix_lens[i] + extend_lens[i]) of its row.
        The first `decode_rows` requests are a mixed batch's decode steps (one token each).

        `positions` overrides the rotary positions (tree drafts sit at depth, not at slot order);
        KV slots always follow the row order so a verify window is contiguous. `device_prefix`:
        the exact prefix lengths when only the device knows them (overlapped speculation); then
        `prefix_lens` is the host's upper bound and only sizes host-side lists.
        """
        self.check_mode(mode)
        dev = self.device
        slots_t, prefix, ext = to_device([slots, prefix_lens, extend_lens], dev).unbind(0)
        if device_prefix is not None:
            prefix = device_prefix
        qo_indptr = torch.zeros(len(slots) + 1, dtype=torch.int64, device=dev)
        torch.cumsum(ext, 0, out=qo_indptr[1:])
        num_tokens = sum(extend_lens)
        row_of_token = torch.repeat_interleave(torch.arange(len(slots), device=dev), ext, output_size=num_tokens)
        offset = torch.arange(num_tokens, device=dev) - qo_indptr[:-1][row_of_token]
        kv_index = prefix[row_of_token] + offset
        out_cache_loc = self.kv.req_to_token[slots_t[row_of_token], kv_index]
        ctx = ForwardContext(
            mode=mode,
            positions=self._positions(kv_index if positions is None else positions),
            out_cache_loc=out_cache_loc,
            req_slots=slots_t,
            seq_lens=prefix + ext,
            extend_lens=ext,
            qo_indptr=qo_indptr,
            req_to_token=self.kv.req_to_token,
            kv_pool=self.pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=[p + e for p, e in zip(prefix_lens, extend_lens)],
            extend_lens_cpu=list(extend_lens),
            tree_mask=tree_mask,
            aux_hidden_layers=aux_hidden_layers,
            decode_rows=decode_rows,
        )
        return ctx

    def window_context(
        self,
        mode: ForwardMode,
        slots: torch.Tensor,
        prefix: torch.Tensor,
        width: int,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        writes: torch.Tensor | None = None,
        aux_hidden_layers: tuple[int, ...] = (),
    ) -> ForwardContext:
        """Every request writes `width` tokens after its `prefix` (device tensors, one per row):
        built by device ops of fixed shapes alone, so a captured graph can build it. Rows of
        slot 0 are padding (their writes land on page 0), and so are rows where `writes`
        (bs * width bools) is false: their queries run, but the KV they would overwrite stays.
        `positions` (bs * width) override the rotary positions (tree nodes sit at their depth);
        KV slots always follow the row order, so a window is contiguous."""
        self.check_mode(mode)
        table = self.kv.req_to_token
        kv_index = (prefix.unsqueeze(1) + self._constant("arange", width, width)).reshape(-1)
        slot_rows = slots.repeat_interleave(width) if width > 1 else slots
        out_cache_loc = table[slot_rows, kv_index.clamp(max=table.shape[1] - 1)]
        if writes is not None:
            out_cache_loc = torch.where(writes, out_cache_loc, 0)
        return self.device_context(
            mode,
            slots,
            self._positions(kv_index if positions is None else positions),
            out_cache_loc,
            prefix + width,
            width,
            tree_mask=tree_mask,
            aux_hidden_layers=aux_hidden_layers,
        )

    def device_context(
        self,
        mode: ForwardMode,
        slots: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        width: int,
        *,
        tree_mask: torch.Tensor | None = None,
        aux_hidden_layers: tuple[int, ...] = (),
    ) -> ForwardContext:
        """The context of `width` tokens per request from device tensors already computed."""
        bs = int(slots.shape[0])
        # the host knows lengths exactly only off the GPU; captured graphs size kernels by the table
        seq_cpu = seq_lens.tolist() if slots.device.type == "cpu" else [int(self.kv.req_to_token.shape[1])] * bs
        return ForwardContext(
            mode=mode,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_slots=slots,
            seq_lens=seq_lens,
            extend_lens=self._constant("full", bs, width),
            qo_indptr=self._constant("indptr", bs, width),
            req_to_token=self.kv.req_to_token,
            kv_pool=self.pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_cpu,
            extend_lens_cpu=[width] * bs,
            tree_mask=tree_mask,
            aux_hidden_layers=aux_hidden_layers,
        )

    def _constant(self, kind: str, bs: int, width: int) -> torch.Tensor:
        """arange(width), full(bs, width) or arange(bs + 1) * width as int64 on the device, made
        once: inside a captured graph each would otherwise be a kernel per replay. Never made
        while capturing (a captured fill runs only at replay), readers never write them."""
        key = (kind, bs, width)
        cached = self._constants.get(key)
        if cached is not None:
            return cached
        dev = self.device
        if kind == "arange":
            t = torch.arange(width, dtype=torch.int64, device=dev)
        elif kind == "full":
            t = torch.full((bs,), width, dtype=torch.int64, device=dev)
        else:
            t = torch.arange(bs + 1, dtype=torch.int64, device=dev) * width
        if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self._constants[key] = t
        return t

    def forward_direct(self, input_ids: torch.Tensor, ctx: ForwardContext, **model_inputs: Any) -> Any:
        """The model on this context now, never through a per-forward graph (for bodies that are
        captured whole, and their padded-eager twins)."""
        return self._forward_eager(input_ids, ctx, model_inputs)

    def _positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions if self.max_position is None else positions.clamp(max=self.max_position)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, **model_inputs: Any) -> Any:
        """Target models return (hidden, aux hidden list); draft heads take `features` and
        return their output hidden states. Served by a CUDA graph when one fits."""
        if self.graphs is not None:
            out = self.graphs.run(input_ids, ctx, model_inputs)
            if out is not None:
                return out
        return self._forward_eager(input_ids, ctx, model_inputs)

    def _forward_eager(self, input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, Any]) -> Any:
        ctx.attn_backend.prepare(ctx)
        return self.model(input_ids, ctx, **model_inputs)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
