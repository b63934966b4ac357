"""The leader rank's executor: runs its own share of every step and tells the followers to run theirs.

The schedule is decided once, by the leader's scheduler, and every rank runs the same executor
calls in the same order (rank-0 scheduling; see engine/parallel/follower.py for the other side).
Calls that run device work (and so collectives) are broadcast as they happen; bookkeeping calls
(admissions, releases, decode plans) and the request table's writes ride with the next of them.
"""

from __future__ import annotations

from typing import Any

from engine.core import Batch, DecodePlan, Req, StepOutput
from engine.executor import Executor
from engine.future_map import BatchRelay, DraftInput, FutureMap
from engine.handoff import HandoffCodec
from engine.kv_cache import KVCacheManager, KVPool
from engine.parallel.channel import PLANS_KEPT, STOP, Op, PlanChannel
from engine.parallel.mirror import ReqEncoder, map_tensors
from engine.spec_stats import SpecStats


class TpLeaderExecutor:
    """Executor protocol over the leader's worker and the plan channel to the followers."""

    def __init__(self, local: Executor, channel: PlanChannel, kv: KVCacheManager) -> None:
        self.local, self.channel, self.kv = local, channel, kv
        self.encoder = ReqEncoder()
        self._pending: list[Op] = []
        self._plan_seq = 0
        self._plan_ids: dict[int, int] = {}
        kv.journal = []

    # ---- calls the followers repeat ----
    def _queue(self, name: str, payload: Any) -> None:
        if self.kv.journal:
            self._pending.append(("table", self._drain_table()))
        self._pending.append((name, payload))

    def _send(self, name: str, payload: Any) -> None:
        self._queue(name, payload)
        ops, self._pending = self._pending, []
        self.channel.send(ops)

    def _drain_table(self) -> list[Any]:
        assert self.kv.journal is not None
        writes, self.kv.journal = self.kv.journal, []
        return writes

    def _batch(self, batch: Batch) -> tuple[Any, ...]:
        plan = self._plan_ids.get(id(batch.plan), -1)
        reqs = [self.encoder.encode(r) for r in batch.reqs]
        return (
            batch.mode,
            reqs,
            batch.extend_lens,
            batch.sample,
            batch.prefix_lens,
            batch.epochs,
            plan,
            batch.decode_rows,
        )

    def step(self, batch: Batch, relay: BatchRelay) -> StepOutput:
        self._send("step", self._batch(batch))
        return self.local.step(batch, relay)

    def launch(self, batch: Batch, relay: BatchRelay) -> Any:
        self._send("launch", self._batch(batch))
        return self.local.launch(batch, relay)

    def collect(self, handle: Any) -> StepOutput:
        self._send("collect", None)
        return self.local.collect(handle)

    def plan_decode(self, batch_size: int, room: int) -> DecodePlan:
        self._queue("plan", (batch_size, room))
        plan = self.local.plan_decode(batch_size, room)
        self._plan_ids[id(plan)] = self._plan_seq
        self._plan_seq += 1
        if len(self._plan_ids) > PLANS_KEPT:
            self._plan_ids.pop(next(iter(self._plan_ids)))
        return plan

    def activate_step_by_batch(self, batch_size: int) -> int:
        self._queue("activate", batch_size)
        return self.local.activate_step_by_batch(batch_size)

    def on_admit(self, req: Req) -> None:
        self._queue("admit", self.encoder.encode(req))
        self.local.on_admit(req)

    def on_release(self, req: Req) -> None:
        self._queue("release", self.encoder.encode(req))
        self.local.on_release(req)
        if req.finished:
            self.encoder.forget(req)

    def adopt_prebuilt(self, reqs: list[Req], draft_input: DraftInput, relay: BatchRelay) -> None:
        encoded = [self.encoder.encode(r) for r in reqs]
        self._send("adopt", (encoded, map_tensors(draft_input, lambda t: t.cpu())))
        self.local.adopt_prebuilt(reqs, draft_input, relay)

    def capture_cuda_graphs(self) -> None:
        self._send("capture", None)
        self.local.capture_cuda_graphs()

    def stop_followers(self) -> None:
        self.channel.send([STOP])

    # ---- the leader's own answers ----
    def bind_future_map(self, future_map: FutureMap) -> None:
        self.local.bind_future_map(future_map)  # each follower built its own copy at start-up

    @property
    def future_map(self) -> FutureMap:
        return self.local.future_map

    def supports_overlap(self) -> bool:
        return self.local.supports_overlap()

    def supports_mixed_batches(self) -> bool:
        return self.local.supports_mixed_batches()

    def settles_grammar_in_launch(self) -> bool:
        """No: followers keep their matchers from the plans, which must carry every earlier token."""
        return False

    def kv_tokens_per_decode(self) -> int:
        return self.local.kv_tokens_per_decode()

    def prefix_cache_shift(self) -> int:
        return self.local.prefix_cache_shift()

    def cacheable_tokens(self, req: Req) -> int:
        return self.local.cacheable_tokens(req)

    def extra_kv_pools(self) -> list[KVPool]:
        return self.local.extra_kv_pools()

    def handoff_codec(self) -> HandoffCodec:
        return self.local.handoff_codec()

    def spec_stats(self) -> SpecStats | None:
        return self.local.spec_stats()

    def adaptive_snapshot(self) -> dict[str, Any] | None:
        return self.local.adaptive_snapshot()
