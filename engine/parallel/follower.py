"""A follower rank: its share of the model and its own worker, running what the leader ran, in order.

Rank-0 scheduling was chosen over identical schedulers on every rank: a scheduler reads clocks
(TPOT guard, timeouts), arrival order and KV transfer completions, any of which could differ
between ranks, and one different decision would desynchronise the collectives. A follower has no
scheduler, no prefix cache and no I/O: it mirrors the leader's requests and request table, and
repeats each executor call. Its results are the leader's (the same logits on every rank, the same
seeds), and are dropped.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from collections import deque
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from common.sampling import Constraint
from engine.algorithm import EngineAlgorithm
from engine.build import build_future_map, build_rank
from engine.config import EngineConfig
from engine.core import PLAIN_DECODE, Batch, DecodePlan
from engine.executor import Executor
from engine.future_map import FutureMap
from engine.grammar.base import GrammarMatcher
from engine.grammar.compiler import GrammarCompiler, make_backend, new_matcher
from engine.kv_cache import KVCacheManager
from engine.kv_transfer.tp import pool_shapes
from engine.loader import tp_layout
from engine.parallel.channel import PLANS_KEPT, Op, PlanChannel, TpGroupFailed
from engine.parallel.group import init_tp_group, leave_tp_group
from engine.parallel.mirror import ReqMirror, map_tensors
from engine.parallel.transfer_service import AppliedPlans, TransferService

log = logging.getLogger(__name__)


class Follower:
    """Applies the leader's ops to this rank's worker."""

    def __init__(
        self,
        executor: Executor,
        kv: KVCacheManager,
        future_map: FutureMap,
        device: torch.device,
        applied: AppliedPlans | None = None,
        grammar_for: Callable[[Constraint], GrammarMatcher] | None = None,
    ) -> None:
        self.executor, self.kv, self.future_map = executor, kv, future_map
        self.applied = applied or AppliedPlans(device)
        self.mirror = ReqMirror(device, grammar_for)
        self.device = device
        self.handles: deque[Any] = deque()
        self.plans: dict[int, DecodePlan] = {}
        self._plan_seq = 0

    def apply(self, ops: list[Op]) -> bool:
        """Run one message's ops; False once told to stop."""
        for name, payload in ops:
            if name == "stop":
                return False
            getattr(self, f"_op_{name}")(payload)
        self.applied.mark()
        return True

    def _op_table(self, writes: list[tuple[int, int | None, list[int] | None]]) -> None:
        for slot, first, pages in writes:
            if pages is None:
                self.kv.req_to_token[slot].zero_()
            else:
                assert first is not None
                self.kv.write_pages(slot, first, pages)

    def _batch(self, payload: tuple[Any, ...]) -> Batch:
        mode, encoded, extend_lens, sample, prefix_lens, epochs, plan, decode_rows = payload
        reqs = [self.mirror.apply(e) for e in encoded]
        plan = self.plans.get(plan, PLAIN_DECODE)
        return Batch(mode, reqs, extend_lens, sample, prefix_lens, epochs, plan, decode_rows=decode_rows)

    def _relay(self, batch: Batch) -> Any:
        return self.future_map.batch([r.slot for r in batch.reqs])

    def _op_step(self, payload: tuple[Any, ...]) -> None:
        batch = self._batch(payload)
        self.executor.step(batch, self._relay(batch))

    def _op_launch(self, payload: tuple[Any, ...]) -> None:
        batch = self._batch(payload)
        self.handles.append(self.executor.launch(batch, self._relay(batch)))

    def _op_collect(self, _: None) -> None:
        self.executor.collect(self.handles.popleft())

    def _op_plan(self, payload: tuple[int, int]) -> None:
        self.plans[self._plan_seq] = self.executor.plan_decode(*payload)
        self.plans.pop(self._plan_seq - PLANS_KEPT, None)
        self._plan_seq += 1

    def _op_activate(self, batch_size: int) -> None:
        self.executor.activate_step_by_batch(batch_size)

    def _op_admit(self, encoded: Any) -> None:
        self.executor.on_admit(self.mirror.apply(encoded))

    def _op_release(self, encoded: Any) -> None:
        req = self.mirror.apply(encoded)
        slot = req.slot
        self.executor.on_release(req)
        self.future_map.invalidate(torch.tensor([slot], dtype=torch.int64))  # as the leader's scheduler does
        if req.finished:
            self.mirror.forget(req.rid)

    def _op_adopt(self, payload: tuple[list[Any], Any]) -> None:
        encoded, draft_input = payload
        reqs = [self.mirror.apply(e) for e in encoded]
        draft_input = map_tensors(draft_input, lambda t: t.to(self.device))
        self.executor.adopt_prebuilt(reqs, draft_input, self.future_map.batch([r.slot for r in reqs]))

    def _op_capture(self, _: None) -> None:
        self.executor.capture_cuda_graphs()


def follower_main(
    rank: int,
    size: int,
    init_method: str,
    config: EngineConfig,
    algorithm: EngineAlgorithm,
    device_name: str,
    link: Connection,
) -> None:
    """The process of one follower rank (started by engine/parallel/ranks.py)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: the node stops its ranks itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # `kill -USR1 <rank pid>` prints where every thread of a rank stands: what a hung collective needs
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _exit_with_parent()
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if "OMP_NUM_THREADS" not in os.environ:  # as the leader's node does: a few small host rows
            torch.set_num_threads(1)
    group = init_tp_group(rank, size, init_method, device, config.tp_timeout_s)
    try:
        parts = build_rank(config, algorithm, device, group)
        future_map = build_future_map(algorithm, config, parts.max_context_len, parts.parts.kv)
        parts.executor.bind_future_map(future_map)
        mc = parts.parts.model_config
        compiler = GrammarCompiler(
            partial(make_backend, config.grammar_backend, config.model, mc.vocab_size, mc.eos_token_ids)
        )
        follower = Follower(
            parts.executor, parts.parts.kv, future_map, device, grammar_for=lambda c: new_matcher(compiler.submit(c))
        )
        pools = lambda: [parts.parts.runner.pool, *parts.executor.extra_kv_pools()]  # noqa: E731
        heads = tp_layout(parts.parts.model_config, group).kv_heads
        TransferService(link, pools, lambda: pool_shapes(pools(), heads), follower.applied)
        channel = PlanChannel(group)
        while follower.apply(channel.recv()):
            pass
    except TpGroupFailed as e:
        log.error("%s; exiting", e)
        os._exit(3)
    except BaseException:
        leave_tp_group(group, together=False)  # this rank alone: the others are still in the group
        raise
    # told to stop: the leader is leaving the group now too
    if not leave_tp_group(group, together=True):
        os._exit(5)


def _exit_with_parent() -> None:
    """A follower outlives no leader: were the node killed, its ranks would hold GPUs for nothing."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(4)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
