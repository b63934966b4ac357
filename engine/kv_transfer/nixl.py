"""NIXL implementation of KVTransport: one agent per node, UCX by default.

Registration: every KV pool buffer (VRAM for CUDA tensors, DRAM for CPU tensors) and the aux
buffer. A write of one request is a single NIXL WRITE of all its (region, page-run) descriptors
plus its aux row, tagged with `completion_tag(room)`: NIXL delivers that tag to the peer only
after the data has landed, so the tag is the decode side's "pages are valid" signal. When the
KV and the aux row live in different memory kinds (GPU KV, host aux rows) one descriptor list
cannot hold both, so the KV goes first untagged and the tagged aux write is posted only after it
completed - the tag still implies everything landed.

Batched writes (`sgl`): NIXL can post a write's descriptors as one UCX scatter-gather list; on
GPUs UCX then issues one batched copy (cuMemcpyBatchAsync) instead of a copy per descriptor, so
that a short prompt's 65 descriptors (per layer K and V, and the row) should cost about what one
does. Off by default until a GPU run measures it (bench/gpu/kv_bandwidth.py).

Safety: descriptors are rebuilt from plain (addr, len, dev) numbers in the peer's MemoryLayout;
nothing received from the network is ever unpickled (NIXL's serialized descs are pickles).
Listening: NIXL runs no listener thread (metadata travels over the nodes' own gRPC), and UCX's TCP
listeners stay on the interface of the node's --host (`listen_host`, engine/kv_transfer/interfaces.py).
Failure: a NIXL error while posting raises TransferError; one seen while polling (or a transfer
outliving `xfer_timeout_s`) makes `poll` return FAILED with the text in `last_error(handle)`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's Python logger prints INFO to stdout

from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # noqa: E402

from common.defaults import check_sgl_mode
from engine.kv_cache import KVPool
from engine.kv_transfer.rows import HandoffRows
from engine.kv_transfer.base import KVPoll, MemoryLayout, TransferError, TransferRequest, completion_tag
from engine.kv_transfer.backend_env import NET_DEVICES_ENV, SGL_ENV, create_backend
from engine.kv_transfer.interfaces import ucx_net_devices
from engine.kv_transfer.nixl_handles import (
    NixlXfer,
    as_str,
    as_xfer,
    aux_desc,
    check_items,
    err_text,
    fail_xfer,
    md_agent_name,
    post_stages,
    release_all,
)
from engine.kv_transfer.layout import coalesce_runs, kv_regions, run_descs, tensor_mem_type

log = logging.getLogger(__name__)
__all__ = ["NET_DEVICES_ENV", "SGL_ENV", "NixlTransport", "create_backend"]
_MEM_TYPES = ("DRAM", "VRAM")


class NixlTransport:
    """KVTransport over a NIXL agent. Thread-safe: every agent call holds one lock."""

    def __init__(
        self,
        name: str,
        pools: Sequence[KVPool],
        aux: HandoffRows,
        backend: str = "UCX",
        *,
        backend_params: dict[str, str] | None = None,
        xfer_timeout_s: float = 60.0,
        progress_thread: bool = False,
        sgl: str = "off",
        listen_host: str | None = None,
    ) -> None:
        self._name, self._pools, self._aux = name, list(pools), aux
        self._timeout = xfer_timeout_s
        self._lock = threading.Lock()
        check_sgl_mode(sgl)  # before the agent exists: nothing to close on a bad mode
        kinds = {tensor_mem_type(p.buffer) for p in self._pools}
        if len(kinds) > 1:
            raise ValueError("all KV pools of one node must live in the same memory kind")
        kv_mem = kinds.pop() if kinds else "DRAM"
        self._layout = MemoryLayout(
            kv=kv_regions(self._pools), aux=aux.region(), mem_type=kv_mem, aux_mem_type=tensor_mem_type(aux.tensor)
        )
        # STRICT: the node's scheduler loop and its gRPC threads share this agent. No progress
        # thread by default: NIXL's busy-polls a whole core, and both sides already drive
        # progress by polling transfers and draining notifications themselves. A receiver that
        # cannot call drain_notifications() regularly must pass progress_thread=True.
        # No listener thread: metadata travels over the node's own KV control channel (gRPC, on
        # the node's --host), so NIXL itself never listens.
        cfg = nixl_agent_config(
            backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
        )
        self._agent: Any = nixl_agent(name, cfg)
        if backend not in self._agent.get_plugin_list():
            raise TransferError(f"NIXL backend {backend!r} is not available (plugins: {self._agent.get_plugin_list()})")
        # "auto": batched on GPUs, where a copy per descriptor is what a write costs; host memory
        # gains nothing from it (UCX copies host memory on the CPU either way)
        self.batched = sgl == "on" or (sgl == "auto" and kv_mem == "VRAM")
        # UCX listens on every interface its TCP transport uses: only on `listen_host`'s
        net_devices = ucx_net_devices(listen_host) if listen_host is not None else None
        create_backend(self._agent, backend, dict(backend_params or {}), self.batched, net_devices)
        log.info(
            "NIXL agent %s: KV in %s, each write posted as %s",
            name,
            kv_mem,
            "one scatter-gather list (UCX SGL)" if self.batched else "a copy per descriptor",
        )
        self._regs: list[Any] = []
        try:
            for t in [p.buffer for p in self._pools] + [aux.tensor]:
                if not t.is_contiguous():
                    raise ValueError("registered buffers must be contiguous")
                desc = (t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0), "")
                self._regs.append(self._agent.register_memory([desc], tensor_mem_type(t)))
        except Exception:
            self.close()
            raise
        self._peers: dict[str, MemoryLayout] = {}
        self._peer_md: dict[str, bytes] = {}
        self._live: set[NixlXfer] = set()
        # Tests flip this to exercise the two-stage path that GPU KV + host aux rows take.
        self._force_split_aux = False

    # ---- identity / handshake ----
    @property
    def name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        with self._lock:
            return bytes(self._live_agent().get_agent_metadata())

    def layout(self) -> MemoryLayout:
        return self._layout

    def peer_layout(self, name: str) -> MemoryLayout | None:
        return self._peers.get(name)

    def add_peer(self, metadata: bytes, layout: MemoryLayout, *, connect: bool = True) -> str:
        why = self._layout.compatible_with(layout)
        if why is None and (layout.mem_type not in _MEM_TYPES or layout.aux_mem_type not in _MEM_TYPES):
            why = f"unknown memory kind ({layout.mem_type}, {layout.aux_mem_type})"
        if why is not None:
            raise TransferError(f"peer layout is incompatible with {self._name!r}: {why}")
        return self.load_agent(metadata, layout, connect=connect)

    def load_agent(self, metadata: bytes, layout: MemoryLayout | None = None, *, connect: bool = True) -> str:
        """Load a peer agent without comparing layouts (a tensor-parallel peer's ranks hold other
        head slices: engine/kv_transfer/tp.py matches them); returns its name."""
        with self._lock:
            agent = self._live_agent()
            if bytes(metadata) == bytes(agent.get_agent_metadata()):
                raise TransferError(f"peer metadata is our own agent's ({self._name!r})")
            hint = md_agent_name(metadata)
            if hint in self._peer_md and self._peer_md[hint] != bytes(metadata):
                # A restarted peer (same name, new metadata): NIXL refuses to load over the stale
                # entry (NIXL_ERR_NOT_ALLOWED), so forget the old endpoint first.
                self._forget(hint)
            try:
                name = as_str(agent.add_remote_agent(metadata))
            except Exception as e:  # e.g. a peer that took our agent name: names must be unique
                raise TransferError(
                    f"cannot load peer metadata into {self._name!r} (an agent "
                    f"named {hint!r} already loaded?): {err_text(e)}"
                ) from e
            try:
                # Pre-warm: the first transfer otherwise pays 15-40 ms of connection setup. One
                # side only: both connecting at once makes UCX's TCP transport refuse one of the
                # two, and a notification sent before any write then never arrives.
                if connect:
                    agent.make_connection(name)
            except Exception as e:
                self._forget(name)
                raise TransferError(f"cannot connect to peer {name!r}: {err_text(e)}") from e
            self._peers[name] = layout if layout is not None else self._layout
            self._peer_md[name] = bytes(metadata)
            return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._forget(name)

    def _forget(self, name: str) -> None:
        self._peers.pop(name, None)
        self._peer_md.pop(name, None)
        if self._agent is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # already gone: nothing left to undo
                log.debug("remove_remote_agent(%s): %s", name, err_text(e))

    # ---- data path ----
    def write(self, req: TransferRequest) -> NixlXfer:
        with self._lock:
            agent = self._live_agent()
            peer = self._peers.get(req.peer)
            if peer is None:
                raise TransferError(f"room {req.room}: unknown peer {req.peer!r}")
            me = self._layout
            check_items("source page", req.src_pages, min((r.count for r in me.kv), default=0))
            check_items("destination page", req.dst_pages, min((r.count for r in peer.kv), default=0))
            if req.src_aux_row is not None and req.dst_aux_row is not None:
                check_items("source aux row", [req.src_aux_row], me.aux.count)
                check_items("destination aux row", [req.dst_aux_row], peer.aux.count)
            try:
                src_start, dst_start, lengths = coalesce_runs(req.src_pages, req.dst_pages)
            except ValueError as e:
                raise TransferError(f"room {req.room}: {e}") from e
            parts = []  # (local rows, local kind, remote rows, remote kind)
            kv_local = run_descs(me.kv, src_start, lengths)
            if kv_local.size:
                parts.append((kv_local, me.mem_type, run_descs(peer.kv, dst_start, lengths), peer.mem_type))
            if req.src_aux_row is not None and req.dst_aux_row is not None:
                parts.append(
                    (
                        aux_desc(me, req.src_aux_row),
                        me.aux_mem_type,
                        aux_desc(peer, req.dst_aux_row),
                        peer.aux_mem_type,
                    )
                )
            if not parts:
                raise TransferError(f"room {req.room}: a partial write needs at least one page")
            split = self._force_split_aux or any(p[1] != parts[-1][1] or p[3] != parts[-1][3] for p in parts)
            if not split and len(parts) == 2:
                parts = [
                    (
                        np.concatenate((parts[0][0], parts[1][0])),
                        parts[1][1],
                        np.concatenate((parts[0][2], parts[1][2])),
                        parts[1][3],
                    )
                ]
            tag = completion_tag(req.room) if req.is_final else b""  # partial writes notify no one
            return self._post_parts(agent, req.room, req.peer, parts, tag)

    def write_rows(
        self,
        room: int,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        tag: bytes = b"",
        kinds: tuple[str, str] | None = None,
    ) -> NixlXfer:
        """Post one write of explicit (addr, len, dev) rows, by default KV memory to the peer's KV
        memory (a tensor-parallel rank's head slices, engine/kv_transfer/tp.py; `kinds`: other
        memory kinds, e.g. a handoff row's); `tag` notifies the peer on completion."""
        with self._lock:
            agent = self._live_agent()
            layout = self._peers.get(peer)
            if layout is None:
                raise TransferError(f"room {room}: unknown peer {peer!r}")
            loc_kind, rem_kind = kinds or (self._layout.mem_type, layout.mem_type)
            parts = [(local, loc_kind, remote, rem_kind)]
            return self._post_parts(agent, room, peer, parts, tag)

    def _post_parts(self, agent: Any, room: int, peer: str, parts: list[Any], tag: bytes) -> NixlXfer:
        """Initialise one NIXL write per part (the last tagged) and post the first (lock held)."""
        stages: list[Any] = []
        try:
            for i, (loc, loc_kind, rem, rem_kind) in enumerate(parts):
                stages.append(
                    agent.initialize_xfer(
                        "WRITE",
                        agent.get_xfer_descs(loc, loc_kind),
                        agent.get_xfer_descs(rem, rem_kind),
                        peer,
                        tag if i == len(parts) - 1 else b"",
                    )
                )
        except Exception as e:
            release_all(stages)
            raise TransferError(f"room {room} -> {peer}: {err_text(e)}") from e
        nbytes = int(sum(int(p[0][:, 1].sum()) for p in parts))
        x = NixlXfer(room, peer, stages, time.monotonic() + self._timeout, nbytes)
        post_stages(agent, x)
        if x.state == KVPoll.FAILED:
            release_all(stages)
            raise TransferError(x.error or "transfer failed")
        self._live.add(x)
        return x

    def poll(self, handle: object) -> KVPoll:
        x = as_xfer(handle)
        with self._lock:
            if x.state != KVPoll.TRANSFERRING:
                return x.state
            if self._agent is None:
                return fail_xfer(x, "transport closed")
            try:
                st = self._agent.check_xfer_state(x.stages[x.stage])
            except Exception as e:
                return fail_xfer(x, err_text(e))
            if st == "DONE":
                x.stage += 1
                if x.stage == len(x.stages):
                    x.state = KVPoll.SUCCESS
                else:
                    post_stages(self._agent, x)
            elif st == "ERR":
                fail_xfer(x, f"NIXL reported an error in stage {x.stage}")
            elif time.monotonic() > x.deadline:
                fail_xfer(x, f"timed out after {self._timeout:.1f}s")
            return x.state

    def last_error(self, handle: object) -> str | None:
        return as_xfer(handle).error

    def release(self, handle: object) -> None:
        x = as_xfer(handle)
        with self._lock:
            self._live.discard(x)
            release_all(x.stages)
            x.stages = []
            if x.state == KVPoll.TRANSFERRING:
                fail_xfer(x, "released while in flight")

    # ---- control messages ----
    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            try:
                self._live_agent().send_notif(peer, message)
            except Exception as e:  # best effort by contract: the peer may already be gone
                log.warning("notify %s failed: %s", peer, err_text(e))

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._agent is None:
                return []
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as e:
                log.warning("get_new_notifs failed: %s", err_text(e))
                return []
        return [(as_str(p), bytes(m)) for p, msgs in notifs.items() for m in msgs]

    def close(self) -> None:
        with self._lock:
            agent, self._agent = getattr(self, "_agent", None), None
            if agent is None:
                return
            for x in list(getattr(self, "_live", ())):
                release_all(x.stages)
                x.stages = []
                if x.state == KVPoll.TRANSFERRING:
                    fail_xfer(x, "transport closed")
            self._live = set()
            for name in list(getattr(self, "_peers", {})):
                try:
                    agent.remove_remote_agent(name)
                except Exception as e:
                    log.debug("remove_remote_agent(%s): %s", name, err_text(e))
            self._peers, self._peer_md = {}, {}
            for reg in self._regs:
                try:
                    agent.deregister_memory(reg)
                except Exception as e:
                    log.warning("deregister_memory failed: %s", err_text(e))
            self._regs = []
        # Dropping the last reference destroys the agent (UCX workers, progress thread).
        del agent

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers (lock held) ----
    def _live_agent(self) -> Any:
        if self._agent is None:
            raise TransferError(f"transport {self._name!r} is closed")
        return self._agent
