"""Triton attention over the paged KV cache: the GPU backend, safe to capture in CUDA graphs.

Every launch grid and scratch shape comes from host values that stay fixed for a captured
batch (batch size, token count, max(extend_lens_cpu), the tree mask's shape, pool and table
shapes); lengths and slots are read on the device. prepare() and forward() never sync.
Short query windows (decode, verify, draft steps) take the split-K kernels, which spread a long
context over many programs; long ones (prefill chunks) take the extend kernel. A mixed batch's
decode rows (`ctx.decode_rows`) take the split-K kernel and its prompt rows the extend kernel: one
extend grid over both would size every decode row's blocks by the chunk's length. Prompt chunks
without a tree mask take the prompt kernel, which reads the chunk's own keys from this forward's
K/V rather than through the request table (bench/gpu/prompt_attention.py measures both).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import triton

from engine.attention.base import AttentionBackend, register_backend
from engine.attention.triton_kernels.common import TileConfig, interpreting
from engine.attention.triton_kernels.decode import SplitConfig, split_kv_attention
from engine.attention.triton_kernels.extend import extend_attention
from engine.attention.triton_kernels.kv_store import store_kv
from engine.attention.triton_kernels.prompt import prompt_attention, prompt_kernel_fits

if TYPE_CHECKING:
    from engine.forward_context import ForwardContext

# a split shorter than this many tokens costs more in the merge than it gains in parallelism
_MIN_SPLIT_TOKENS = 128
_MAX_SPLITS = 64
# windows of at most this many (token, head) rows per kv head take the split-K path
SPLIT_MAX_ROWS = 64


@dataclass
class _Meta:
    max_extend: int  # host upper bound of extend_lens (past a mixed batch's decode rows): sizes the grids
    tree_mask: torch.Tensor | None  # (bs, max_q, W) uint8 view of ctx.tree_mask


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch_size: int, kv_heads: int, max_context: int, sm_count: int) -> int:
    """Static split count: about 4 waves of programs over the SMs, fewer for big batches."""
    want = triton.cdiv(4 * sm_count, max(1, batch_size * kv_heads))
    by_length = triton.cdiv(max_context, _MIN_SPLIT_TOKENS)
    return max(1, min(want, by_length, _MAX_SPLITS))


def split_config(
    rows: int, batch_size: int, kv_heads: int, max_context: int, device: torch.device, num_splits: int | None = None
) -> SplitConfig:
    if num_splits is None:
        num_splits = choose_num_splits(batch_size, kv_heads, max_context, _sm_count(device))
    block_m = max(16, triton.next_power_of_2(rows))  # tl.dot needs >= 16 rows
    if interpreting() or device.type != "cuda":
        return SplitConfig(num_splits, block_m, block_n=16)
    # measured on an H200 (bf16, dim 128, GQA 4:1): 2 warps and 3 stages keep the most loads in
    # flight for 16-32 row tiles (decode bs 64 at 4K: ~4 TB/s)
    return SplitConfig(num_splits, block_m, block_n=64, num_warps=2 if block_m <= 32 else 4, num_stages=3)


def extend_config(head_dim: int, device: torch.device) -> TileConfig:
    """Long tree-masked windows (and chunks over a pool of another dtype): 128-row tiles of
    (token, head) pairs for tensor-core throughput (a fresh 4K prompt on an H200: ~364 TFLOP/s
    causal, against the prompt kernel's ~447)."""
    if interpreting() or device.type != "cuda":
        return TileConfig(block_m=16, block_n=16)
    warps = 8 if head_dim > 64 else 4
    return TileConfig(block_m=128, block_n=128 if head_dim <= 128 else 64, num_warps=warps, num_stages=3)


def prompt_config(device: torch.device) -> TileConfig:
    """Tiles of one query head's 64 tokens against 64 keys, the fastest of a sweep on an H200 for
    fresh prompts, batched prompts and chunks over a prefix (bench/gpu/prompt_attention.py)."""
    if interpreting() or device.type != "cuda":
        return TileConfig(block_m=16, block_n=16)
    return TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


class TritonAttention(AttentionBackend):
    name = "triton"
    graph_safe = True

    def __init__(
        self, num_kv_splits: int | None = None, split_max_rows: int = SPLIT_MAX_ROWS, prompt_kernel: bool = True
    ) -> None:
        self.num_kv_splits = num_kv_splits  # None: chosen per batch size from the SM count
        self.split_max_rows = split_max_rows  # tests move it to run either kernel on any window
        self.prompt_kernel = prompt_kernel  # off: prompt chunks take the paged extend kernel

    def prepare(self, ctx: "ForwardContext") -> None:
        if ctx.positions.device.type != "cuda" and not interpreting():
            raise RuntimeError(
                "the triton attention backend needs CUDA tensors "
                "(or TRITON_INTERPRET=1 for CPU tests); use the torch backend"
            )
        # extend_lens_cpu is set for the padded batch under graphs; num_tokens bounds it anyway
        lens = ctx.extend_lens_cpu[ctx.decode_rows :]
        max_extend = max(lens) if lens else ctx.num_tokens
        tree = None
        if ctx.tree_mask is not None:
            tree = ctx.tree_mask.contiguous().view(torch.uint8)
        ctx.attn_metadata = _Meta(max_extend, tree)

    def store(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, ctx: "ForwardContext") -> None:
        store_kv(k, v, ctx.kv_pool.k(layer_id), ctx.kv_pool.v(layer_id), ctx.out_cache_loc)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float, ctx: "ForwardContext"
    ) -> torch.Tensor:
        pool = ctx.kv_pool
        k_cache, v_cache = pool.k(layer_id), pool.v(layer_id)
        self.store(k, v, layer_id, ctx)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty_like(q)
        if ctx.num_tokens == 0:
            return out
        meta: _Meta = ctx.attn_metadata
        d = ctx.decode_rows
        if d:  # decode rows: the first d tokens, one per request
            self._split(q[:d], k_cache, v_cache, _rows(ctx, slice(0, d)), ctx, None, 1, scale, out[:d])
            if d == ctx.batch_size:
                return out
        rows = _rows(ctx, slice(d, None) if d else None)
        group = q.shape[1] // k_cache.shape[1]
        if not d and meta.max_extend * group <= self.split_max_rows:
            return self._split(q, k_cache, v_cache, rows, ctx, meta.tree_mask, meta.max_extend, scale, out)
        if self._takes_prompt_kernel(q, k, k_cache, meta):
            k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
            return prompt_attention(
                q, k, v, k_cache, v_cache, ctx.req_to_token, *rows, meta.max_extend, scale, prompt_config(q.device), out
            )
        return extend_attention(
            q,
            k_cache,
            v_cache,
            ctx.req_to_token,
            *rows,
            meta.max_extend,
            meta.tree_mask,
            scale,
            extend_config(q.shape[2], q.device),
            out,
        )

    def _takes_prompt_kernel(self, q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor, meta: _Meta) -> bool:
        """Chunks read their own keys as computed, so the pool must hold them unchanged (same
        dtype); tree masks stay with the extend kernel."""
        return (
            self.prompt_kernel
            and meta.tree_mask is None
            and k.dtype == k_cache.dtype
            and prompt_kernel_fits(q.shape[2])
        )

    def _split(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: "RowTensors",
        ctx: "ForwardContext",
        tree_mask: torch.Tensor | None,
        max_extend: int,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """The split-K kernel over the requests of `rows` (whose tokens are all of `q`)."""
        kv_heads = k_cache.shape[1]
        cfg = split_config(
            max_extend * (q.shape[1] // kv_heads),
            int(rows[0].shape[0]),
            kv_heads,
            ctx.req_to_token.shape[1],
            q.device,
            self.num_kv_splits,
        )
        return split_kv_attention(q, k_cache, v_cache, ctx.req_to_token, *rows, tree_mask, scale, cfg, out)


# (request slots, sequence lengths, extend lengths, query offsets) of some of a batch's requests
RowTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _rows(ctx: "ForwardContext", rows: slice | None) -> RowTensors:
    """The per-request tensors of requests `rows` (None: all of them, the context's own tensors:
    no views made per layer on the common path)."""
    if rows is None:
        return ctx.req_slots, ctx.seq_lens, ctx.extend_lens, ctx.qo_indptr
    stop = None if rows.stop is None else rows.stop + 1
    return ctx.req_slots[rows], ctx.seq_lens[rows], ctx.extend_lens[rows], ctx.qo_indptr[rows.start : stop]


register_backend("triton", TritonAttention)
