"""The committed pdserve/v1 wire code: up to date with proto/, messages round-trip, KVControl serves."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.fingerprint import Fingerprint, first_mismatch
from pdserve.v1 import kv_control_pb2 as pb
from pdserve.v1 import kv_control_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
TIMEOUT_S = 10.0

REGION = {"addr": 0x7F00_0000_1000, "item_bytes": 4096, "count": 128, "device_id": 1}
LAYOUT = {
    "kv": [REGION, dict(REGION, addr=0x7F00_0010_0000)],
    "aux": dict(REGION, count=64),
    "mem_type": "VRAM",
    "aux_mem_type": "VRAM",
}
FINGERPRINT = {
    "model_hash": "ab" * 32,
    "dtype": "bfloat16",
    "page_size": 16,
    "kv_layout": "nhd",
    "spec_algorithm": "EAGLE3",
    "draft_model_hash": "cd" * 32,
    "aux_row_bytes": 8192,
    "version": "0.1.0",
    "tp_layout": "tp=2;kv_heads=0-3,4-7",
}
# One fully populated instance per message; test_every_message_has_a_sample keeps this complete.
SAMPLES: dict[str, dict[str, Any]] = {
    "Region": REGION,
    "MemoryLayout": LAYOUT,
    "Fingerprint": FINGERPRINT,
    "HandshakeRequest": {
        "decode_agent": "decode-0",
        "nixl_metadata": b"\x00\x01meta\xff",
        "layout": LAYOUT,
        "fingerprint": FINGERPRINT,
    },
    "HandshakeResponse": {
        "prefill_agent": "prefill-0",
        "nixl_metadata": b"\xfe\x00meta",
        "layout": LAYOUT,
        "fingerprint": FINGERPRINT,
    },
    "DestinationRequest": {
        "room": 2**63 + 5,
        "request_id": "chatcmpl-1",
        "decode_agent": "decode-0",
        "pages": [3, 1, 4, 1, 5],
        "aux_row": 7,
        "num_tokens": 77,
        "deadline_unix_s": 1.7e9 + 0.25,
        "cached_pages": 2,
    },
    "DestinationAck": {"accepted": True, "error": "none"},
    "AbortRoomRequest": {"room": 42, "reason": "client went away"},
    "AbortRoomAck": {"writes": pb.ROOM_WRITES_IN_FLIGHT},
}


def test_committed_code_matches_regeneration(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the `test` extra) regenerates the code")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr

    def generated(root: Path) -> dict[str, bytes]:
        return {
            p.name: p.read_bytes() for p in sorted((root / "pdserve" / "v1").iterdir()) if p.name.endswith(GENERATED)
        }

    fresh, committed = generated(tmp_path), generated(ROOT)
    assert fresh, "generate.py produced nothing"
    assert sorted(fresh) == sorted(committed), "run `python proto/generate.py` and commit pdserve/v1"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"pdserve/v1 is stale ({stale}): run `python proto/generate.py` and commit"


def test_every_message_has_a_sample() -> None:
    assert sorted(pb.DESCRIPTOR.message_types_by_name) == sorted(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_message_round_trip(name: str) -> None:
    cls = getattr(pb, name)
    msg = cls(**SAMPLES[name])
    # Every field carries a non-default value, so a field dropped on the wire would show.
    assert len(msg.ListFields()) == len(cls.DESCRIPTOR.fields)
    back = cls.FromString(msg.SerializeToString())
    assert back == msg
    assert back.SerializeToString() == msg.SerializeToString()


def test_fingerprint_proto_round_trip() -> None:
    fp = Fingerprint(**FINGERPRINT)
    assert fp.to_proto() == pb.Fingerprint(**FINGERPRINT)
    assert Fingerprint.from_proto(pb.Fingerprint.FromString(fp.to_proto().SerializeToString())) == fp


def test_memory_layout_round_trip_keeps_the_aux_memory_kind() -> None:
    """A VRAM aux buffer must reach the peer as VRAM: its descriptors name that memory kind."""
    from engine.kv_transfer.base import MemoryLayout, Region
    from engine.kv_transfer.wire import layout_from_proto, layout_to_proto

    layout = MemoryLayout((Region(4096, 256, 8, 1),), Region(8192, 64, 4, 1), "VRAM", "VRAM")
    wire = pb.MemoryLayout.FromString(layout_to_proto(layout).SerializeToString())
    assert layout_from_proto(wire) == layout
    wire.ClearField("aux_mem_type")  # a node from before the field: host rows
    assert layout_from_proto(wire).aux_mem_type == "DRAM"


class _Prefill(pb_grpc.KVControlServicer):
    """The handshake half of a prefill servicer: refuse a mismatched decode, as nodes must."""

    def __init__(self, fingerprint: Fingerprint) -> None:
        self.fingerprint = fingerprint

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeResponse:
        why = first_mismatch(self.fingerprint, Fingerprint.from_proto(request.fingerprint))
        if why is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return pb.HandshakeResponse(
            prefill_agent="prefill-0",
            nixl_metadata=b"prefill-meta",
            layout=pb.MemoryLayout(**LAYOUT),
            fingerprint=self.fingerprint.to_proto(),
        )


async def _handshake_round(mine: Fingerprint, theirs: Fingerprint) -> tuple[Any, str | None]:
    server = grpc.aio.server()
    pb_grpc.add_KVControlServicer_to_server(_Prefill(mine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), TIMEOUT_S)
            stub = pb_grpc.KVControlStub(channel)
            req = pb.HandshakeRequest(
                decode_agent="decode-0",
                nixl_metadata=b"decode-meta",
                layout=pb.MemoryLayout(**LAYOUT),
                fingerprint=theirs.to_proto(),
            )
            try:
                return await stub.Handshake(req, timeout=TIMEOUT_S), None
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
    finally:
        await server.stop(grace=None)


def test_kvcontrol_handshake_over_loopback() -> None:
    fp = Fingerprint(**FINGERPRINT)
    resp, details = asyncio.run(asyncio.wait_for(_handshake_round(fp, fp), 3 * TIMEOUT_S))
    assert details is None
    assert resp.prefill_agent == "prefill-0" and resp.nixl_metadata == b"prefill-meta"
    assert Fingerprint.from_proto(resp.fingerprint) == fp
    assert list(resp.layout.kv) == [pb.Region(**r) for r in LAYOUT["kv"]]


def test_kvcontrol_handshake_refuses_mismatch() -> None:
    fp = Fingerprint(**FINGERPRINT)
    decode = Fingerprint(**dict(FINGERPRINT, page_size=4))
    code, details = asyncio.run(asyncio.wait_for(_handshake_round(fp, decode), 3 * TIMEOUT_S))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == "page_size differs: prefill 16, decode 4"


def test_generated_code_does_not_import_torch() -> None:
    code = textwrap.dedent("""
        import sys
        import pdserve.v1.kv_control_pb2, pdserve.v1.kv_control_pb2_grpc
        assert "torch" not in sys.modules, "pdserve.v1 pulled in torch"
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
