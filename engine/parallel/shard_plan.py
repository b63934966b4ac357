"""Which slice of each checkpoint tensor a tensor-parallel rank reads (HF Llama-family names)."""

from __future__ import annotations

from dataclasses import dataclass

from common.tp_layout import TpLayout


@dataclass(frozen=True)
class Slice:
    """Rows `[start, stop)` of dimension `dim` of a checkpoint tensor."""

    dim: int
    start: int
    stop: int


# name suffix -> (dimension, which of the layout's ranges, in units of a head's width or not)
_ROW_HEADS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_ROW_KV_HEADS = (
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
)
_COL_HEADS = ("self_attn.o_proj.weight",)
_ROW_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_COL_MLP = ("mlp.down_proj.weight",)
_ROW_VOCAB = ("embed_tokens.weight", "lm_head.weight")


class ShardPlan:
    """Slices for one rank; tensors it does not name (norms, q/k norms) are read whole."""

    def __init__(self, layout: TpLayout, head_dim: int) -> None:
        self.layout, self.head_dim = layout, head_dim

    def slice_of(self, name: str) -> Slice | None:
        if self.layout.size == 1:
            return None
        lay, hd = self.layout, self.head_dim
        if name.endswith(_ROW_HEADS):
            return Slice(0, lay.heads.start * hd, lay.heads.stop * hd)
        if name.endswith(_ROW_KV_HEADS):
            return Slice(0, lay.kv_heads.start * hd, lay.kv_heads.stop * hd)
        if name.endswith(_COL_HEADS):
            return Slice(1, lay.heads.start * hd, lay.heads.stop * hd)
        if name.endswith(_ROW_MLP):
            return Slice(0, lay.intermediate.start, lay.intermediate.stop)
        if name.endswith(_COL_MLP):
            return Slice(1, lay.intermediate.start, lay.intermediate.stop)
        if name.endswith(_ROW_VOCAB):  # the last block may be short: the rest stays zero (padding)
            return Slice(0, lay.vocab.start, lay.vocab.stop)
        return None

    def padded(self, name: str) -> bool:
        """A vocabulary block, whose parameter may have more rows than its slice."""
        return self.layout.size > 1 and name.endswith(_ROW_VOCAB)
