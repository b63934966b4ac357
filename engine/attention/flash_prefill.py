"""The triton backend, with a long prompt that has no cached prefix attended by torch's flash kernel.

Such a prompt attends only to its own keys, which this forward computed and holds contiguous, so
it needs no paged reads: torch's flash attention (native GQA) ran that causal attention at about
1.6x the paged Triton extend kernel's rate on an H200 (515 against 325 TFLOP/s at 4K tokens), and
attention is a sixth of a 4K prompt's forward on the 8B shape. A batch of several such prompts
(a prefill node batches them) runs one flash call per prompt. Everything else goes to the triton
backend: decode rows, cached prefixes, speculative trees, batches holding a prompt under
`min_tokens`, and CUDA graph capture. If torch has no flash kernel for the inputs (a GPU or
dtype it does not cover), the first refusal is logged and the triton kernel serves from then on.
`--attention-backend triton_flash`; not the default until measured on GPUs (bench/gpu/perf.py
--backend triton_flash).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from engine.attention.base import AttentionBackend, register_backend
from engine.attention.triton_backend import TritonAttention

if TYPE_CHECKING:
    from engine.forward_context import ForwardContext

log = logging.getLogger(__name__)

# Below this many tokens a prompt's attention is a small share of its forward, and prompts of a
# few hundred tokens are served from CUDA graphs, which keep the triton kernel.
FLASH_MIN_TOKENS = 1024


class FlashPrefillAttention(AttentionBackend):
    name = "triton_flash"
    graph_safe = True  # the flash path is never taken while a graph is captured

    def __init__(self, min_tokens: int | None = None) -> None:
        self.paged = TritonAttention()
        self.min_tokens = FLASH_MIN_TOKENS if min_tokens is None else min_tokens
        self.refused: str | None = None  # why torch refused its flash kernel, once it did

    def prepare(self, ctx: "ForwardContext") -> None:
        self.paged.prepare(ctx)

    def store(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, ctx: "ForwardContext") -> None:
        self.paged.store(k, v, layer_id, ctx)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float, ctx: "ForwardContext"
    ) -> torch.Tensor:
        if self.refused is None and self.fresh_prompts(ctx):
            out = self._flash_each(q, k, v, scale, ctx.extend_lens_cpu)
            if out is not None:
                self.paged.store(k, v, layer_id, ctx)  # later chunks and decode steps read it
                return out
        return self.paged.forward(q, k, v, layer_id, scale, ctx)

    def fresh_prompts(self, ctx: "ForwardContext") -> bool:
        """Prompts only (no decode rows, no tree), each with nothing cached before it and at least
        min_tokens long, and no graph being captured (host values that a capture does not hold)."""
        if ctx.decode_rows or ctx.tree_mask is not None or not ctx.extend_lens_cpu:
            return False
        if len(ctx.seq_lens_cpu) != len(ctx.extend_lens_cpu):
            return False
        if ctx.positions.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        return all(e == s >= self.min_tokens for e, s in zip(ctx.extend_lens_cpu, ctx.seq_lens_cpu))

    def _flash_each(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lens: list[int]
    ) -> torch.Tensor | None:
        """Each request's rows (packed in order) attended over its own keys; None when refused."""
        if len(lens) == 1:
            return self._flash(q, k, v, scale)
        out = torch.empty_like(q)
        start = 0
        for n in lens:
            rows = slice(start, start + n)
            part = self._flash(q[rows], k[rows], v[rows], scale)
            if part is None:
                return None
            out[rows] = part
            start += n
        return out

    def _flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """Causal attention of q over k, v (tokens, heads, dim) by torch's flash kernel alone;
        None (and the triton kernel from then on) when torch has none for these inputs."""
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0),
                    k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=q.shape[1] != k.shape[1],
                )
        except RuntimeError as e:  # no flash kernel for this device, dtype or shape
            self.refused = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("torch's flash attention refused a prompt (%s): the triton kernel serves prompts", self.refused)
            return None
        return out.squeeze(0).transpose(0, 1)  # (tokens, heads, dim)


register_backend("triton_flash", FlashPrefillAttention)
