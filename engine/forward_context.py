"""The explicit per-forward context handed to every model call (no globals), and the attention
backend interface that reads it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.core import ForwardMode

if TYPE_CHECKING:
    from engine.kv_cache import KVPool


@dataclass
class ForwardContext:
    """Everything a forward needs besides the token ids.

    Tokens of all requests are packed: request i owns query rows
    [qo_indptr[i], qo_indptr[i+1]). `seq_lens[i]` is the KV length *after* this forward's
    tokens are stored (prefix + new), so query row j of request i sits at position
    `seq_lens[i] - extend_lens[i] + j`.
    """

    mode: ForwardMode
    positions: torch.Tensor  # (num_tokens,) int64
    out_cache_loc: torch.Tensor  # (num_tokens,) int64 token slots to write K/V into
    req_slots: torch.Tensor  # (bs,) int64 rows of the request table
    seq_lens: torch.Tensor  # (bs,) int64
    extend_lens: torch.Tensor  # (bs,) int64
    qo_indptr: torch.Tensor  # (bs + 1,) int64
    req_to_token: torch.Tensor  # (max_reqs + 1, max_context) int64
    kv_pool: "KVPool"
    attn_backend: "AttentionBackend"
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    # Tree attention: (bs, max_q, W) bool over each request's last W keys, True where query q may
    # see that key (its ancestors and itself). Keys before the window are always visible.
    # None means plain causal attention (prefill, decode, chain verify).
    tree_mask: torch.Tensor | None = None
    # layers whose outputs the model must also return (EAGLE-3 low/mid/high features)
    aux_hidden_layers: tuple[int, ...] = ()
    # A mixed batch (decode steps and a prompt chunk in one EXTEND forward): its first
    # `decode_rows` requests have one query token each, the first `decode_rows` tokens, and attend
    # as decode steps do (a backend may run them with its decode kernel); 0: no such split.
    decode_rows: int = 0
    attn_metadata: Any = None  # filled by attn_backend.prepare(ctx)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def with_pool(self, kv_pool: "KVPool") -> "ForwardContext":
        """The same batch geometry against another pool (draft model forwards)."""
        ctx = ForwardContext(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        ctx.kv_pool = kv_pool
        return ctx


class AttentionBackend(ABC):
    """Stores new K/V into the paged pool and attends over each request's cached context."""

    name: str = "base"
    # True when prepare() and forward() never sync with the host nor allocate device-dependent
    # shapes, so a CUDA graph may capture them (graph runners check it)
    graph_safe: bool = False

    def prepare(self, ctx: "ForwardContext") -> None:  # noqa: B027 - optional hook, no-op default
        """Build per-forward metadata once (shared by all layers); default: nothing."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scale: float, ctx: "ForwardContext"
    ) -> torch.Tensor:
        """q: (tokens, heads, dim); k, v: (tokens, kv_heads, dim). Returns (tokens, heads, dim)."""

    def store(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, ctx: "ForwardContext") -> None:
        """Write k, v (tokens, kv_heads, dim) at ctx.out_cache_loc without attending (a forward
        that only fills the cache); needs no prepare()."""
        ctx.kv_pool.store(layer_id, ctx.out_cache_loc, k, v)
