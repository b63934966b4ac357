"""The tensor-parallel group a rank belongs to: torch.distributed (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from common.tp_layout import TpLayout
from engine.graph_registry import release_graphs_on

log = logging.getLogger(__name__)

# NVLink multicast stays off on shared machines (NCCL's NVLS and symmetric memory's multicast
# can wedge a GPU other tenants use); every rank process starts with these.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class TpGroup:
    """A rank's view of its tensor-parallel group; size 1 is a single GPU and every collective a
    no-op, so models call these unconditionally."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # device collectives (NCCL or gloo)
    cpu_group: dist.ProcessGroup | None = None  # host messages (gloo): the leader's plans, no deadline
    device: torch.device = torch.device("cpu")  # this rank's

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel outputs, the vocabulary-parallel embedding)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def layout(self, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int) -> TpLayout:
        return TpLayout(self.rank, self.size, num_heads, num_kv_heads, intermediate_size, vocab_size)


SINGLE = TpGroup()
LEAVE_S = 30.0  # a group's teardown, every rank in it
DRAIN_S = 5.0  # the device's last work before it
PLAN_WAIT = datetime.timedelta(days=365)


def init_tp_group(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> TpGroup:
    """Join the group at `init_method` (tcp://host:port). Collectives that do not complete within
    `timeout_s` raise instead of hanging the node (NCCL's watchdog, gloo's own timeout)."""
    if size == 1:
        return SINGLE
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout, **kwargs)
    # The plan channel's own group: a follower waits on it for the leader's next step as long as
    # the node is idle, so it has no deadline worth the name (a dead leader is seen otherwise: its
    # socket closes, and followers exit with their parent); collectives keep `timeout_s`.
    plans = dist.new_group(backend="gloo", timeout=PLAN_WAIT)
    return TpGroup(rank, size, dist.group.WORLD, plans, device)


def leave_tp_group(group: TpGroup, together: bool) -> bool:
    """Tear down this rank's groups; False (logged) if that did not finish within LEAVE_S.

    `together`: every rank is leaving now, in order (the leader told its followers to stop), so
    NCCL's graceful destroy, which every rank must enter, completes. Otherwise (a rank died, the
    group broke) an abort tears down this rank's communicators alone. Either runs under a
    deadline: a rank whose teardown is stuck should exit rather than hang its node's stop."""
    if group.size == 1 or not dist.is_initialized():
        return True
    _report_stuck_device_work(group.device)
    # NCCL waits, in both teardowns, until no captured graph of its collectives lives
    released = release_graphs_on(group.device)
    log.debug("rank %d: released %d CUDA graphs before leaving", group.rank, released)
    teardown = dist.destroy_process_group if together else _abort_process_group
    done = _within(LEAVE_S, _on(group.device, teardown), "tp-leave")
    if not done:
        log.error("rank %d: leaving the tensor-parallel group did not finish within %.0f s", group.rank, LEAVE_S)
    return done


def _report_stuck_device_work(device: torch.device) -> None:
    """A device that does not drain before the group goes is waiting on a collective no other
    rank will ever join: a rank ran device work the others did not. Say so, as it is a bug."""
    if device.type == "cuda":
        if not _within(DRAIN_S, _on(device, torch.cuda.synchronize), "tp-drain"):
            log.error("device work still running %.0f s after the last step: a collective no rank joined", DRAIN_S)


def _on(device: torch.device, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with `device` current on the thread that runs it (a new thread starts on cuda:0)."""
    if device.type != "cuda":
        return fn

    def run() -> object:
        with torch.cuda.device(device):
            return fn()

    return run


def _within(seconds: float, fn: Callable[[], object], name: str) -> bool:
    """Run `fn` on a daemon thread; True if it returned (or raised, logged) within `seconds`."""

    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a teardown error: logged, the caller goes on
            log.warning("%s: %s: %s", name, type(e).__name__, e)

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(seconds)
    return not worker.is_alive()
