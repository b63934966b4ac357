"""One node's PD endpoint: its transport over every KV pool, its aux rows, its fingerprint.

Both roles derive the aux layout the same way, from the executor (draft hidden width and
dtype when the algorithm carries them), so identical configurations produce identical rows.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch

from engine.compat import Fingerprint, build_fingerprint
from engine.kv_transfer import AuxBuffer, AuxLayout, KVTransport, create_transport


@dataclass
class Endpoint:
    transport: KVTransport
    aux: AuxBuffer
    fingerprint: Fingerprint


def kv_pools(engine: Any) -> list[Any]:
    extra = getattr(engine.executor, "extra_kv_pools", None)
    return [engine.parts.runner.pool] + (list(extra()) if extra else [])


def aux_layout(engine: Any) -> AuxLayout:
    hidden = getattr(engine.executor, "handoff_hidden", None)
    if hidden is None:
        return AuxLayout()
    size, dtype = hidden()
    return AuxLayout(hidden_size=size, hidden_dtype=dtype)


def build_endpoint(engine: Any, *, kind: str, role: str, aux_rows: int, spec_algorithm: str,
                   draft_model_dir: str | None) -> Endpoint:
    pools = kv_pools(engine)
    aux = AuxBuffer(aux_layout(engine), aux_rows, device="cpu")  # aux rows live in host memory
    name = f"pdserve-{role}-{uuid.uuid4().hex[:12]}"
    transport = create_transport(kind, name, pools, aux)
    cfg = engine.config
    kv_layout = "page-major;" + ";".join(
        f"{p.num_layers}x2x{p.num_kv_heads}x{p.head_dim}:{str(p.buffer.dtype).removeprefix('torch.')}"
        for p in pools)
    fp = build_fingerprint(cfg.model, str(engine.dtype).removeprefix("torch."), cfg.page_size, kv_layout,
                           spec_algorithm.upper(), draft_model_dir, aux.layout.row_bytes)
    return Endpoint(transport, aux, fp)


def handoff_tensors(spec_state: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(topk_p, topk_index, hidden) from a worker's per-request state, duck-typed."""
    if spec_state is None:
        return None, None, None
    return (getattr(spec_state, "topk_p", None), getattr(spec_state, "topk_index", None),
            getattr(spec_state, "hidden", None))


def room_echo(room: int) -> int:
    """The aux row's echo for a room: never 0 (0 marks an empty row), even for room 0."""
    return room + 1
