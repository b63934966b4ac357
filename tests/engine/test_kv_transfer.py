"""Tests for engine.kv_transfer: handoff rows, layouts, the fake transport, and real NIXL between two
processes (this process writes; a child running this file as a script owns the destination).

Every wait has a deadline and every child process is killed in a `finally`.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kv_cache import KVPool
from engine.kv_transfer import (HandoffRows, KVPoll, MemoryLayout, Region, TransferError,
                                TransferRequest, coalesce_runs, create_transport, failure_tag,
                                kv_regions, nixl_available, page_descs, parse_tag, run_descs)
from engine.kv_transfer.wire import layout_from_proto, layout_to_proto

ROOT = Path(__file__).resolve().parents[2]
HAVE_NIXL = nixl_available()
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="nixl_cu13 is not installed")
DEADLINE_S = 10.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Two pools like target + draft: same page ids, different page sizes in bytes.
SMALL = {"pools": [[2, 12, 4, 2, 8, "float32"], [2, 12, 4, 1, 16, "bfloat16"]],
         "aux": [200, 8], "seed": 7}
# One pool of 1024 usable pages x (K+V) x 32 KiB = 64 MiB, for the bandwidth probe.
BIG = {"pools": [[1, 1025, 16, 8, 128, "bfloat16"]], "aux": [0, 4], "seed": 11}


# ---- shared by this process and the child ---------------------------------------------------

def make_pools(spec: dict[str, Any], fill: bool) -> list[KVPool]:
    pools = []
    for i, (layers, pages, page_size, heads, head_dim, dt) in enumerate(spec["pools"]):
        pool = KVPool(layers, pages, page_size, heads, head_dim, DTYPES[dt], spec.get("device", "cpu"))
        if fill:
            g = torch.Generator().manual_seed(spec["seed"] + i)
            pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(DTYPES[dt]))
        else:  # touch the pages as a long-lived pool's are: time the copy, not page faults
            pool.buffer.fill_(0)
        pools.append(pool)
    return pools


def make_aux(spec: dict[str, Any]) -> HandoffRows:
    payload_bytes, rows = spec["aux"]
    return HandoffRows(payload_bytes, rows, device=spec.get("device", "cpu"))  # beside the KV, as nodes do


def expected_payload(spec: dict[str, Any], room: int) -> torch.Tensor:
    """Opaque row bytes derived from the room, so a row written for another room is recognisable."""
    n = spec["aux"][0]
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(room), dtype=torch.uint8)


def layout_from_json(d: dict[str, Any]) -> MemoryLayout:
    return MemoryLayout(kv=tuple(Region(**r) for r in d["kv"]), aux=Region(**d["aux"]),
                        mem_type=d["mem_type"], aux_mem_type=d["aux_mem_type"])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def verify(spec: dict[str, Any], pools: list[KVPool], aux: HandoffRows, cmd: dict[str, Any],
           written: set[int]) -> str | None:
    """Destination pages equal the source pages byte for byte, nothing else was touched, and the
    aux row carries this room. Returns what is wrong, or None."""
    src = make_pools(spec, fill=True)
    s_idx = torch.tensor(cmd["src_pages"], dtype=torch.int64)
    d_idx = torch.tensor(cmd["dst_pages"], dtype=torch.int64)
    written.update(cmd["dst_pages"])
    for i, (s, d) in enumerate(zip(src, pools)):
        if not torch.equal(_bytes(d.buffer[:, :, d_idx]), _bytes(s.buffer[:, :, s_idx])):
            return f"pool {i}: destination pages differ from the source pages"
        untouched = [p for p in range(d.buffer.shape[2]) if p not in written]
        if bool(_bytes(d.buffer[:, :, untouched]).any()):
            return f"pool {i}: a page outside the destination list was written"
    echo, payload = aux.read(cmd["dst_row"])
    if (echo, aux.room_of(cmd["dst_row"])) != (cmd["room"], cmd["room"]):
        return f"row echo {echo} != room {cmd['room']}"
    if not torch.equal(payload.cpu(), expected_payload(spec, cmd["room"])):
        return "row payload differs"
    return None


def reader_main(spec: dict[str, Any]) -> None:
    """Child: own zeroed pools + aux, publish metadata/layout, then serve `expect` commands."""
    from engine.kv_transfer.nixl import NixlTransport

    def out(**kw: Any) -> None:
        print("@@ " + json.dumps(kw), flush=True)

    pools, aux = make_pools(spec, fill=False), make_aux(spec)
    # this child blocks on stdin between commands, so it cannot drive UCX progress itself
    t = NixlTransport(spec["name"], pools, aux, progress_thread=True)
    out(md=base64.b64encode(t.metadata()).decode(), layout=dataclasses.asdict(t.layout()))
    written: set[int] = set()
    for line in sys.stdin:  # EOF (parent gone) ends the child
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        deadline, found, others = time.monotonic() + DEADLINE_S, None, []
        while found is None and time.monotonic() < deadline:
            for peer, msg in t.drain_notifications():
                kind, room, reason = parse_tag(msg)
                if found is None and (kind, room) == (cmd["kind"], cmd["room"]):
                    found = (peer, reason)
                else:
                    others.append(msg.decode())
            time.sleep(1e-4)
        if found is None:
            out(ok=False, error=f"no {cmd['kind']} notification for room {cmd['room']}")
            continue
        err = verify(spec, pools, aux, cmd, written) if cmd.get("verify") else None
        out(ok=err is None, error=err, peer=found[0], reason=found[1], others=others)
    t.close()


# ---- child process handling -----------------------------------------------------------------

class Child:
    """The reader process, spoken to with JSON lines; stdout is pumped by a thread so every
    receive can time out."""

    def __init__(self, spec: dict[str, Any]) -> None:
        # the repo first, then whatever path the parent was given (wheels installed with --target)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, NIXL_LOG_LEVEL="WARN")
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(spec)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            hello = self.recv()
        except BaseException:
            self.kill()
            raise
        self.metadata = base64.b64decode(hello["md"])
        self.layout = layout_from_json(hello["layout"])

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.lines.put(line[3:])

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 2 * DEADLINE_S) -> dict[str, Any]:
        try:
            return json.loads(self.lines.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"reader silent for {timeout}s (exit code {self.proc.poll()})") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=DEADLINE_S)


def wait_done(t: Any, h: object, timeout: float = DEADLINE_S) -> KVPoll:
    deadline = time.monotonic() + timeout
    while (st := t.poll(h)) == KVPoll.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0)
    return st


def write_aux_row(spec: dict[str, Any], aux: HandoffRows, room: int, k: int = 0) -> tuple[int, dict[str, Any]]:
    row = aux.alloc()
    assert row is not None
    aux.write(row, room, expected_payload(spec, room))
    return row, {}


# ---- handoff rows ----------------------------------------------------------------------------

@pytest.mark.parametrize("payload_bytes", [0, 1, 56, 200, 4096 + 3])
def test_rows_round_trip(payload_bytes: int) -> None:
    buf = HandoffRows(payload_bytes, 4)
    assert buf.row_bytes % 64 == 0 and buf.row_bytes >= 8 + payload_bytes
    assert buf.region().item_bytes == buf.row_bytes and buf.region().count == 4
    row = buf.alloc()
    data = torch.randint(0, 256, (payload_bytes,), dtype=torch.uint8)
    buf.write(row, 2**62 + 5, data)
    other = buf.alloc()
    buf.write(other, 9, data[: payload_bytes // 2].flip(0))  # a neighbouring row must not disturb this one
    echo, got = buf.read(row)
    assert echo == 2**62 + 5 and buf.room_of(row) == 2**62 + 5 and torch.equal(got, data)
    short = buf.read(other)[1]
    assert torch.equal(short[: payload_bytes // 2], data[: payload_bytes // 2].flip(0))
    assert not bool(short[payload_bytes // 2:].any())  # a short payload is zero-padded


def test_rows_accounting_and_stale_rows() -> None:
    buf = HandoffRows(16, 4)
    rows = [buf.alloc() for _ in range(3)]
    assert rows == [1, 2, 3] and buf.alloc() is None and buf.num_free == 0
    buf.check()
    buf.write(2, 77, torch.ones(8, dtype=torch.uint8))
    buf.free(2)
    assert buf.room_of(2) == 0 and not bool(buf.tensor[2].any())  # echo zeroed: stale row fails
    with pytest.raises(RuntimeError):
        buf.free(2)
    buf.free(1)
    assert [buf.alloc(), buf.alloc()] == [2, 1]  # FIFO
    buf.check()
    with pytest.raises(IndexError):
        buf.write(0, 1, torch.zeros(1, dtype=torch.uint8))  # row 0 is reserved
    with pytest.raises(ValueError):
        buf.write(1, 0, torch.zeros(1, dtype=torch.uint8))  # room 0 means empty
    with pytest.raises(ValueError):
        buf.write(1, 3, torch.zeros(17, dtype=torch.uint8))  # does not fit
    with pytest.raises(ValueError):
        buf.write(1, 3, torch.zeros(2, dtype=torch.float32))  # bytes only


# ---- layouts --------------------------------------------------------------------------------

def test_kv_regions_and_descriptors() -> None:
    pools = make_pools(SMALL, fill=True)
    regions = kv_regions(pools)
    assert len(regions) == 2 * 2 * 2
    r = regions[3]  # pool 0, layer 1, v
    assert r.addr == pools[0].buffer[1, 1].data_ptr() and r.item_bytes == pools[0].page_bytes
    assert regions[4].item_bytes == pools[1].page_bytes and r.count == 12
    s, d, n = coalesce_runs([3, 4, 5, 9, 10], [7, 8, 2, 11, 12])
    assert (s.tolist(), d.tolist(), n.tolist()) == ([3, 5, 9], [7, 2, 11], [2, 1, 2])
    ones = run_descs(regions, *coalesce_runs([1, 5], [1, 5])[0::2])
    assert [tuple(map(int, x)) for x in ones] == page_descs(regions, [1, 5])


# ---- fake transport -------------------------------------------------------------------------

def test_fake_transport_moves_pages_and_aux() -> None:
    spec = dict(SMALL)
    src_pools, dst_pools = make_pools(spec, fill=True), make_pools(spec, fill=False)
    src_aux, dst_aux = make_aux(spec), make_aux(spec)
    a = create_transport("fake", "fake-prefill", src_pools, src_aux)
    b = create_transport("fake", "fake-decode", dst_pools, dst_aux)
    try:
        peer = a.add_peer(b.metadata(), b.layout())
        assert b.add_peer(a.metadata(), a.layout()) == "fake-prefill"
        row, info = write_aux_row(spec, src_aux, 4242, 4)
        cmd = {"room": 4242, "src_pages": [3, 4, 9], "dst_pages": [7, 8, 2], "dst_row": 5, **info}
        h = a.write(TransferRequest(4242, peer, cmd["src_pages"], cmd["dst_pages"], row, 5))
        assert a.poll(h) == KVPoll.SUCCESS
        [(sender, msg)] = b.drain_notifications()
        assert sender == "fake-prefill" and parse_tag(msg) == ("done", 4242, "")
        assert verify(spec, dst_pools, dst_aux, cmd, set()) is None
        b.notify("fake-prefill", failure_tag(4242, "oom"))
        assert [parse_tag(m) for _, m in a.drain_notifications()] == [("fail", 4242, "oom")]
        a.fail_mode = "fail"
        assert a.poll(a.write(TransferRequest(1, peer, [1], [1], row, 1))) == KVPoll.FAILED
        a.fail_mode = "raise"
        with pytest.raises(TransferError):
            a.write(TransferRequest(1, peer, [1], [1], row, 1))
        bad = dataclasses.replace(b.layout(), aux=dataclasses.replace(b.layout().aux, item_bytes=64))
        with pytest.raises(TransferError, match="aux row size"):
            a.add_peer(b.metadata(), bad)
        with pytest.raises(ValueError, match="unknown transport"):
            create_transport("rdma", "x", [], src_aux)
    finally:
        a.close()
        b.close()


# ---- real NIXL, two processes ---------------------------------------------------------------

@contextlib.contextmanager
def nixl_pair(base: dict[str, Any], tag: str) -> Iterator[tuple[Any, Child, list[KVPool], HandoffRows, str]]:
    """(writer transport here, reader child, writer pools, writer aux, peer name); both torn down."""
    from engine.kv_transfer.nixl import NixlTransport

    spec = dict(base, name=f"{tag}-reader-{os.getpid()}")
    pools, aux = make_pools(spec, fill=True), make_aux(spec)
    child = Child(spec)
    try:
        with NixlTransport(f"{tag}-writer-{os.getpid()}", pools, aux) as t:
            # the layout crosses the control plane's wire form, as between nodes
            layout = layout_from_proto(layout_to_proto(child.layout))
            yield t, child, pools, aux, t.add_peer(child.metadata, layout)
    finally:
        child.kill()


@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nixl_vram_pages_and_row_in_one_transfer() -> None:
    """KV and handoff rows in VRAM on both sides (as GPU nodes keep them): one write moves a
    request's pages and its row, in one stage, with one completion notification."""
    with nixl_pair(dict(SMALL, device="cuda:0"), "vram") as (t, child, _, aux, peer):
        assert child.layout.aux_mem_type == "VRAM" and t.layout().aux_mem_type == "VRAM"
        for room, src, dst, dst_row in [(11, [3, 4, 5, 9], [7, 8, 2, 10], 3), (12, [1], [6], 4)]:
            row, info = write_aux_row(SMALL, aux, room)
            child.send(op="expect", kind="done", room=room, verify=True, src_pages=src, dst_pages=dst,
                       dst_row=dst_row, **info)
            h = t.write(TransferRequest(room, peer, src, dst, row, dst_row))
            assert len(h.stages) == 1
            assert wait_done(t, h) == KVPoll.SUCCESS, t.last_error(h)
            t.release(h)
            reply = child.recv()
            assert reply["ok"], reply["error"]
            aux.free(row)


@needs_nixl
def test_nixl_refuses_incompatible_layout() -> None:
    from engine.kv_transfer.nixl import NixlTransport

    with NixlTransport(f"compat-{os.getpid()}", make_pools(SMALL, fill=False), make_aux(SMALL)) as t:
        lay, kv = t.layout(), list(t.layout().kv)
        kv[5] = dataclasses.replace(kv[5], item_bytes=kv[5].item_bytes * 2)
        for bad, what in [(dataclasses.replace(lay, aux=dataclasses.replace(lay.aux, item_bytes=128)), "aux row size"),
                          (dataclasses.replace(lay, kv=lay.kv[:-2]), "number of KV regions"),
                          (dataclasses.replace(lay, kv=tuple(kv)), "KV region 5 page size"),
                          (lay, "our own agent")]:
            with pytest.raises(TransferError, match=what):
                t.add_peer(t.metadata(), bad)


@needs_nixl
def test_nixl_two_process_write() -> None:
    with nixl_pair(SMALL, "data") as (t, child, _, aux, peer):
        assert t.add_peer(child.metadata, child.layout) == peer  # idempotent
        # Runs where only one side is consecutive must not be merged (3,4,5 -> 7,8,2).
        cases = [(101, [3, 4, 5, 9], [7, 8, 2, 10], 3, 4, False),
                 (202, [1, 2], [4, 5], 4, 16, True),   # two-stage path (GPU KV + host aux)
                 (303, [], [], 5, 1, False)]           # aux row only (full prefix hit)
        for room, src, dst, dst_row, k, split in cases:
            row, info = write_aux_row(SMALL, aux, room, k)
            t._force_split_aux = split
            child.send(op="expect", kind="done", room=room, verify=True, src_pages=src,
                       dst_pages=dst, dst_row=dst_row, **info)
            h = t.write(TransferRequest(room, peer, src, dst, row, dst_row))
            assert wait_done(t, h) == KVPoll.SUCCESS, t.last_error(h)
            t.release(h)
            reply = child.recv()
            assert reply["ok"], reply["error"]
            assert reply["peer"] == t.name and reply["others"] == []  # exactly one tag per write
            aux.free(row)
        t.notify(peer, failure_tag(404, "cancelled"))
        child.send(op="expect", kind="fail", room=404)
        reply = child.recv()
        assert reply["ok"] and reply["reason"] == "cancelled"
        with pytest.raises(TransferError, match="destination page 12 out of range"):
            t.write(TransferRequest(9, peer, [1], [12], 1, 1))
        with pytest.raises(TransferError, match="unknown peer"):
            t.write(TransferRequest(9, "nobody", [1], [1], 1, 1))
        aux.check()


@needs_nixl
def test_nixl_dead_peer_fails_fast_and_restarted_peer_reconnects() -> None:
    with nixl_pair(SMALL, "doomed") as (t, child, _, aux, peer):
        row, _ = write_aux_row(SMALL, aux, 55, 2)
        h = t.write(TransferRequest(55, peer, [1, 2], [3, 4], row, 1))
        assert wait_done(t, h) == KVPoll.SUCCESS  # the connection is up before the peer dies
        t.release(h)
        child.kill()
        start = time.monotonic()
        try:
            h = t.write(TransferRequest(56, peer, [1, 2], [3, 4], row, 2))
            assert wait_done(t, h) == KVPoll.FAILED and t.last_error(h)
            t.release(h)
        except TransferError as e:
            assert "room 56" in str(e)
        assert time.monotonic() - start < DEADLINE_S
        t.notify(peer, failure_tag(56, "x"))  # best effort: must not raise
        reborn = Child(dict(SMALL, name=peer))  # a restarted peer reuses its name
        try:
            assert t.add_peer(reborn.metadata, reborn.layout) == peer
            reborn.send(op="expect", kind="done", room=57)
            h = t.write(TransferRequest(57, peer, [1], [3], row, 2))
            assert wait_done(t, h) == KVPoll.SUCCESS, t.last_error(h)
            assert reborn.recv()["ok"]
        finally:
            reborn.kill()


@needs_nixl
def test_nixl_64mib_bandwidth() -> None:
    """Informative: prints the one-off bandwidth of a 64 MiB write (run with -s to see it)."""
    with nixl_pair(BIG, "bw") as (t, child, _, aux, peer):
        pages = list(range(1, 1025))
        for room, dst, label in [(1, pages, "contiguous"), (2, pages[::-1], "scattered 32 KiB")]:
            aux.write(1, room, expected_payload(BIG, room))
            start = time.perf_counter()
            h = t.write(TransferRequest(room, peer, pages, dst, 1, 1))
            assert wait_done(t, h) == KVPoll.SUCCESS, t.last_error(h)
            dt = time.perf_counter() - start
            t.release(h)
            print(f"\nNIXL WRITE {label}: {h.nbytes / 2**20:.1f} MiB in {dt * 1e3:.1f} ms "
                  f"= {h.nbytes / dt / 1e9:.2f} GB/s")
            child.send(op="expect", kind="done", room=room, verify=room == 1, src_pages=pages,
                       dst_pages=dst, dst_row=1)
            reply = child.recv()
            assert reply["ok"], reply["error"]


if __name__ == "__main__":
    reader_main(json.loads(sys.argv[1]))
