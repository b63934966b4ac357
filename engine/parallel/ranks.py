"""A node's tensor-parallel ranks: the follower processes, the group, and the watch over both.

The node process is rank 0 (the leader: scheduler, I/O, transfers). It starts one process per
other rank, joins the group with them, and watches them: a follower that exits for any reason
marks the engine failed at once (the node then reports NOT_SERVING and routers fail over), and a
collective that misses `tp_timeout_s` raises in the leader's step, with the same result.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import torch

from engine.algorithm import EngineAlgorithm
from engine.config import EngineConfig
from engine.executor import Executor
from engine.kv_cache import KVCacheManager
from engine.parallel.channel import PlanChannel
from engine.parallel.follower import follower_main
from engine.parallel.group import NO_MULTICAST_ENV, SINGLE, TpGroup, init_tp_group, leave_tp_group
from engine.parallel.leader import TpLeaderExecutor
from engine.parallel.links import RankLink

log = logging.getLogger(__name__)

_JOIN_S = 10.0


def rank_device(device: torch.device, rank: int) -> str:
    """Rank r's device: the r-th GPU after the leader's, or the CPU for every rank."""
    if device.type != "cuda":
        return str(device)
    return f"cuda:{(device.index or 0) + rank}"


class TpRanks:
    """The group of one node; on a single GPU a group of one with nothing to watch."""

    def __init__(self, group: TpGroup, procs: list[BaseProcess], links: list[RankLink] | None = None) -> None:
        self.group, self.procs = group, procs
        self.links: list[RankLink] = links or []  # per follower: its KV transfer agent's requests
        self.failed: str | None = None
        self._leader: TpLeaderExecutor | None = None
        self._stopping = threading.Event()
        if procs:
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    @staticmethod
    def start(config: EngineConfig, algorithm: EngineAlgorithm, device: torch.device) -> "TpRanks":
        if config.tp_size == 1:
            return TpRanks(SINGLE, [])
        for key, value in NO_MULTICAST_ENV.items():  # inherited by the followers
            os.environ.setdefault(key, value)
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA state
        procs, links = [], []
        for rank in range(1, config.tp_size):
            mine, theirs = ctx.Pipe()
            args = (rank, config.tp_size, init, config, algorithm, rank_device(device, rank), theirs)
            p = ctx.Process(target=follower_main, args=args, name=f"pdserve-tp{rank}", daemon=True)
            p.start()
            theirs.close()
            procs.append(p)
            links.append(RankLink(rank, mine))
        try:
            group = init_tp_group(0, config.tp_size, init, device, config.tp_timeout_s)
        except Exception:
            for p in procs:
                p.kill()
            raise
        return TpRanks(group, procs, links)

    def lead(self, executor: Executor, kv: KVCacheManager) -> Executor:
        """The executor the scheduler drives: the leader's worker, repeated on every follower."""
        if self.group.size == 1:
            return executor
        self._leader = TpLeaderExecutor(executor, PlanChannel(self.group, self._broken), kv)
        return self._leader

    def plans_sent(self) -> int:
        """Plan messages the leader has broadcast (0 on one GPU)."""
        return self._leader.channel.sent if self._leader is not None else 0

    def _broken(self, why: str) -> None:
        if self.failed is None and not self._stopping.is_set():
            self.failed = why
            log.error("%s: this node cannot step again", why)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = wait(list(sentinels))
        if self._stopping.is_set():
            return
        p = sentinels[ready[0]]  # type: ignore[index]
        p.join(1.0)  # the exit code is set once the process is reaped
        self.failed = f"tensor-parallel rank {self.procs.index(p) + 1} exited (code {p.exitcode})"
        log.error("%s: this node cannot step again", self.failed)

    def stop(self) -> None:
        """Tell the followers to stop, leave the group with them, then make sure they have exited."""
        if not self.procs or self._stopping.is_set():
            return
        self._stopping.set()
        told = False
        if self._leader is not None and self.failed is None:
            try:
                self._leader.stop_followers()
                told = True
            except Exception as e:  # noqa: BLE001 - a broken group: the kill below still stops them
                log.warning("could not tell the followers to stop: %s", e)
        # at once, not after the joins: NCCL's graceful teardown needs every rank in it together
        leave_tp_group(self.group, together=told)
        for p in self.procs:
            p.join(_JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(_JOIN_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
