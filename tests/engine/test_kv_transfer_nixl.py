"""Real NIXL between two processes: this process writes, a child (tests/engine/kv_transfer_kit.py
run as a script) owns the destination pools and rows and checks every byte. Every wait has a
deadline and every child is killed in a `finally`."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from engine.kv_transfer import KVPoll, TransferError, TransferRequest, failure_tag
from tests.engine.kv_transfer_kit import (
    BIG,
    DEADLINE_S,
    SMALL,
    Child,
    expected_payload,
    make_aux,
    make_pools,
    needs_nixl,
    nixl_pair,
    wait_done,
    write_aux_row,
)


@pytest.mark.slow  # a child process owns the destination
@needs_nixl
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("sgl", ["off", "auto"])
def test_nixl_vram_pages_and_row_in_one_transfer(sgl: str) -> None:
    """KV and handoff rows in VRAM on both sides (as GPU nodes keep them): one write moves a
    request's pages and its row, in one stage, with one completion notification; "auto" posts
    it as one scatter-gather list (one batched CUDA copy)."""
    with nixl_pair(dict(SMALL, device="cuda:0"), "vram", sgl=sgl) as (t, child, _, aux, peer):
        assert t.batched == (sgl == "auto")
        assert child.layout.aux_mem_type == "VRAM" and t.layout().aux_mem_type == "VRAM"
        for room, src, dst, dst_row in [(11, [3, 4, 5, 9], [7, 8, 2, 10], 3), (12, [1], [6], 4)]:
            row = write_aux_row(SMALL, aux, room)
            child.send(op="expect", kind="done", room=room, verify=True, src_pages=src, dst_pages=dst, dst_row=dst_row)
            h = t.write(TransferRequest(room, peer, src, dst, row, dst_row))
            assert len(h.stages) == 1
            assert wait_done(t, h) == KVPoll.SUCCESS, t.last_error(h)
            t.release(h)
            reply = child.recv()
            assert reply["ok"], reply["error"]
            aux.free(row)


@needs_nixl
def test_nixl_sgl_modes_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto" batches only GPU KV (host memory: off); the mode, not the inherited environment,
    decides, and the environment is left as it was (also the UCX device list a listen host sets
    for the backend's creation); a bad mode names the flag."""
    from engine.kv_transfer.nixl import NET_DEVICES_ENV, SGL_ENV, NixlTransport

    monkeypatch.setenv(SGL_ENV, "1")
    monkeypatch.delenv(NET_DEVICES_ENV, raising=False)
    for mode, batched in [("auto", False), ("off", False), ("on", True)]:
        pools, aux = make_pools(SMALL, fill=False), make_aux(SMALL)
        with NixlTransport(f"sgl-{mode}-{os.getpid()}", pools, aux, sgl=mode, listen_host="127.0.0.1") as t:
            assert t.batched is batched
        assert os.environ[SGL_ENV] == "1" and NET_DEVICES_ENV not in os.environ
    with pytest.raises(ValueError, match="--kv-write-sgl must be one of off, on, auto, got 'yes'"):
        NixlTransport(f"sgl-bad-{os.getpid()}", make_pools(SMALL, fill=False), make_aux(SMALL), sgl="yes")


@needs_nixl
def test_nixl_refuses_incompatible_layout() -> None:
    from engine.kv_transfer.nixl import NixlTransport

    with NixlTransport(f"compat-{os.getpid()}", make_pools(SMALL, fill=False), make_aux(SMALL)) as t:
        lay, kv = t.layout(), list(t.layout().kv)
        kv[5] = dataclasses.replace(kv[5], item_bytes=kv[5].item_bytes * 2)
        for bad, what in [
            (dataclasses.replace(lay, aux=dataclasses.replace(lay.aux, item_bytes=128)), "aux row size"),
            (dataclasses.replace(lay, kv=lay.kv[:-2]), "number of KV regions"),
            (dataclasses.replace(lay, kv=tuple(kv)), "KV region 5 page size"),
            (lay, "our own agent"),
        ]:
            with pytest.raises(TransferError, match=what):
                t.add_peer(t.metadata(), bad)


@pytest.mark.slow  # a child process owns the destination
@needs_nixl
@pytest.mark.parametrize("sgl", ["off", "on"])
def test_nixl_two_process_write(sgl: str) -> None:
    """Every byte lands and exactly one tag per write arrives, with writes posted a copy per
    descriptor or as one scatter-gather list."""
    with nixl_pair(SMALL, "data", sgl=sgl) as (t, child, _, aux, peer):
        assert t.batched == (sgl == "on")
        assert t.add_peer(child.metadata, child.layout) == peer  # idempotent
        # Runs where only one side is consecutive must not be merged (3,4,5 -> 7,8,2).
        cases = [
            (101, [3, 4, 5, 9], [7, 8, 2, 10], 3, False),
            (202, [1, 2], [4, 5], 4, True),  # two-stage path (GPU KV + host aux)
            (303, [], [], 5, False),
        ]  # aux row only (full prefix hit)
        for room, src, dst, dst_row, split in cases:
            row = write_aux_row(SMALL, aux, room)
            t._force_split_aux = split
            child.send(op="expect", kind="done", room=room, verify=True, src_pages=src, dst_pages=dst, dst_row=dst_row)
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


@pytest.mark.slow  # a child process owns the destination
@needs_nixl
def test_nixl_dead_peer_fails_fast_and_restarted_peer_reconnects() -> None:
    with nixl_pair(SMALL, "doomed") as (t, child, _, aux, peer):
        row = write_aux_row(SMALL, aux, 55)
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


@pytest.mark.slow  # a child process owns the destination
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
            print(
                f"\nNIXL WRITE {label}: {h.nbytes / 2**20:.1f} MiB in {dt * 1e3:.1f} ms "
                f"= {h.nbytes / dt / 1e9:.2f} GB/s"
            )
            child.send(op="expect", kind="done", room=room, verify=room == 1, src_pages=pages, dst_pages=dst, dst_row=1)
            reply = child.recv()
            assert reply["ok"], reply["error"]
