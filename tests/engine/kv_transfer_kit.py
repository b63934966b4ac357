"""Shared by the KV transfer tests: pool specs, byte-exact page checks, the NIXL reader child.

The child is this file run as a script: it owns the destination pools and handoff rows, publishes
its NIXL metadata and layout, then checks each write the parent announces. Every wait has a
deadline; the parent kills the child in a `finally`.
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
from engine.kv_transfer import HandoffRows, KVPoll, MemoryLayout, Region, nixl_available, parse_tag
from engine.kv_transfer.wire import layout_from_proto, layout_to_proto

ROOT = Path(__file__).resolve().parents[2]
HAVE_NIXL = nixl_available()
needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="nixl_cu13 is not installed")
DEADLINE_S = 10.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Two pools like target + draft: same page ids, different page sizes in bytes.
SMALL = {"pools": [[2, 12, 4, 2, 8, "float32"], [2, 12, 4, 1, 16, "bfloat16"]], "aux": [200, 8], "seed": 7}
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
    return MemoryLayout(
        kv=tuple(Region(**r) for r in d["kv"]),
        aux=Region(**d["aux"]),
        mem_type=d["mem_type"],
        aux_mem_type=d["aux_mem_type"],
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def verify(
    spec: dict[str, Any], pools: list[KVPool], aux: HandoffRows, cmd: dict[str, Any], written: set[int]
) -> str | None:
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
        self.proc = subprocess.Popen(
            [sys.executable, __file__, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
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


def write_aux_row(spec: dict[str, Any], aux: HandoffRows, room: int) -> int:
    row = aux.alloc()
    assert row is not None
    aux.write(row, room, expected_payload(spec, room))
    return row


# ---- real NIXL, two processes ---------------------------------------------------------------


@contextlib.contextmanager
def nixl_pair(
    base: dict[str, Any], tag: str, **transport_kw: Any
) -> Iterator[tuple[Any, Child, list[KVPool], HandoffRows, str]]:
    """(writer transport here, reader child, writer pools, writer aux, peer name); both torn down.
    `transport_kw` go to the writer's NixlTransport."""
    from engine.kv_transfer.nixl import NixlTransport

    spec = dict(base, name=f"{tag}-reader-{os.getpid()}")
    pools, aux = make_pools(spec, fill=True), make_aux(spec)
    child = Child(spec)
    try:
        with NixlTransport(f"{tag}-writer-{os.getpid()}", pools, aux, **transport_kw) as t:
            # the layout crosses the control plane's wire form, as between nodes
            layout = layout_from_proto(layout_to_proto(child.layout))
            yield t, child, pools, aux, t.add_peer(child.metadata, layout)
    finally:
        child.kill()


if __name__ == "__main__":
    reader_main(json.loads(sys.argv[1]))
