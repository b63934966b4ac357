"""Memory layouts to and from the pdserve.v1 KV control messages."""

from __future__ import annotations

from engine.kv_transfer.base import MemoryLayout, Region
from pdserve.v1 import kv_control_pb2 as kpb


def _region(r: kpb.Region) -> Region:
    return Region(r.addr, r.item_bytes, r.count, r.device_id)


def layout_from_proto(m: kpb.MemoryLayout) -> MemoryLayout:
    return MemoryLayout(tuple(_region(r) for r in m.kv), _region(m.aux), m.mem_type or "DRAM", m.aux_mem_type or "DRAM")


def layout_to_proto(layout: MemoryLayout) -> kpb.MemoryLayout:
    def reg(r: Region) -> kpb.Region:
        return kpb.Region(addr=r.addr, item_bytes=r.item_bytes, count=r.count, device_id=r.device_id)

    return kpb.MemoryLayout(
        kv=[reg(r) for r in layout.kv], aux=reg(layout.aux), mem_type=layout.mem_type, aux_mem_type=layout.aux_mem_type
    )
