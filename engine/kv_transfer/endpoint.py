"""One node's PD endpoint: its transport over every KV pool, its handoff rows, its fingerprint.

Both roles size the handoff rows the same way, from the executor's handoff codec, so identical
configurations produce identical rows (and a different algorithm or draft a different size,
which the fingerprint refuses at handshake).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.defaults import check_rows_place
from common.fingerprint import Fingerprint, build_fingerprint
from engine.kv_cache import KV_LAYOUT
from engine.kv_transfer import HandoffRows, KVTransport, create_transport
from engine.kv_transfer.tp import TpTransport, pool_shapes

if TYPE_CHECKING:
    from engine.disagg import DisaggEngine


@dataclass
class Endpoint:
    transport: KVTransport
    rows: HandoffRows
    fingerprint: Fingerprint


def build_endpoint(
    pd: "DisaggEngine",
    *,
    kind: str,
    role: str,
    rows: int,
    spec_algorithm: str,
    draft_model_dir: str | None,
    rows_at: str = "kv",
    sgl: str = "off",
    host: str | None = None,
) -> Endpoint:
    """`rows_at`: "kv" keeps the handoff rows on the KV pools' device, so on GPUs a request's row
    rides in its pages' NIXL transfer (one stage); "host" keeps them in host memory, whose write
    is a second stage posted when the pages' stage completes. Peers may differ: each side's
    layout tells the other its rows' memory kind. `sgl` (NIXL only): how writes are posted, see
    --kv-write-sgl; it matters where writes start, on prefill nodes. `host` (NIXL only): the
    address the node serves on; the transport listens there only."""
    check_rows_place(rows_at)
    pools = pd.kv_pools()
    pd.allocate_whole_runs()  # a write takes a descriptor per run of pages, on both sides
    handoff = HandoffRows(pd.handoff_bytes, rows, device=pools[0].buffer.device if rows_at == "kv" else "cpu")
    name = f"pdserve-{role}-{uuid.uuid4().hex[:12]}"
    options = {"sgl": sgl, "listen_host": host} if kind == "nixl" else {}
    transport = create_transport(kind, name, pools, handoff, **options)
    ranks = pd.ranks
    if kind == "nixl":  # every rank's agent, so peers of any tensor-parallel size can pair
        shapes = pool_shapes(pools, pd.tp_kv_heads)
        transport = TpTransport(transport, shapes, ranks.links, ranks.plans_sent, kind, options)
    elif ranks.group.size > 1:
        raise ValueError(f"KV transfer backend {kind!r} is in-process only; a tensor-parallel node needs 'nixl'")
    cfg = pd.config
    # the target's KV heads over all ranks: nodes of different TP sizes pair (each rank's slice
    # is in the transport's metadata, matched head for head)
    heads = [pd.num_kv_heads] + [p.num_kv_heads for p in pools[1:]]
    kv_layout = f"{KV_LAYOUT};" + ";".join(
        f"{p.num_layers}x2x{h}x{p.head_dim}:{str(p.buffer.dtype).removeprefix('torch.')}" for p, h in zip(pools, heads)
    )
    fp = build_fingerprint(
        cfg.model,
        str(pd.dtype).removeprefix("torch."),
        cfg.page_size,
        kv_layout,
        spec_algorithm.upper(),
        draft_model_dir,
        handoff.row_bytes,
        tp_size=ranks.group.size,
    )
    return Endpoint(transport, handoff, fp)


def room_echo(room: int) -> int:
    """The handoff row's echo for a room: never 0 (0 marks an empty row), even for room 0."""
    return room + 1
