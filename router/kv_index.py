"""The router's picture of each node's prefix cache, from the node's KV event stream: how much of a request it holds.

One task per node follows SubscribeKvEvents (started and stopped with the registry, as one of its
followers) and keeps the set of block hashes the node reported cached. A request's chain hashes
(common/prefix_hash.py, for the node's page size: GetServerInfo's server_args.page_size, else the
events' block_size, else 16) are computed once per request and page size; its expected hit on a
node is the longest run of them, from the first, in that node's set.

Every (re)subscription starts from sequence 0: a pdserve node then answers with a snapshot. Resuming
from our cursor after a broken stream could skip a restarted node's new life (its numbers start
again), and a snapshot costs one message per few thousand pages. A gap inside a stream (a batch
that is not the next number) drops the node's set and resubscribes. A node that does not publish
events (UNIMPLEMENTED: no prefix cache, or another engine) is asked again only every minute and
counts as holding nothing. The picture lags the node by its flush interval (~50 ms) plus the
network; the hit is an estimate (an EAGLE node also needs the token after a page to match).

That lag is longer than a chat client's pause between turns: a follow-up sent as its reply ends
found the node's picture without the turn before it (half the follow-ups of the CPU prefix-cache
bench), so the decode node holding the whole conversation looked a turn short and the follow-up
went to the prefill node. So the router also writes what it knows at once: when a request ends on
a node that caches, the pages of its prompt and output count as held there (`expect`),
provisionally, until the node's own events confirm or remove them or PROVISIONAL_TTL_S passes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict, deque
from typing import Callable, Sequence

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from common.prefix_hash import ROOT, chain_hashes
from router.contract import GenerationJob
from router.nodes import NodeState

log = logging.getLogger(__name__)
DEFAULT_PAGE_SIZE = 16  # what a node that names no page size is taken to use (SGLang's default)
# How long pages the router expects a node to hold count without the node's events saying so:
# many times the nodes' flush interval, short enough that a page the node never stored is soon forgotten.
PROVISIONAL_TTL_S = 2.0


class NodeView:
    """One node's cached block hashes as its stream told them, the next batch number expected, and
    the hashes the router expects it to hold before its events say so (with their expiry)."""

    def __init__(self, role: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.role, self.clock = role, clock
        self.blocks: set[int] = set()
        self.provisional: dict[int, float] = {}  # hash -> when it stops counting
        self._expiries: deque[tuple[float, list[int]]] = deque()  # (when, hashes), oldest first
        self.cursor: int | None = None  # None: any batch may come next (a fresh subscription)
        self.block_size = 0  # from the events (0: none seen)
        self.streaming = False  # a batch came since the last (re)subscription: the node caches

    def reset(self) -> None:
        self.blocks.clear()
        self.provisional.clear()
        self._expiries.clear()
        self.cursor = None
        self.streaming = False

    def holds(self, block: int) -> bool:
        if block in self.blocks:
            return True
        until = self.provisional.get(block)
        return until is not None and until > self.clock()

    def expect(self, hashes: Sequence[int], ttl_s: float = PROVISIONAL_TTL_S) -> None:
        """Count `hashes` as held for `ttl_s` unless the events say otherwise first (a node that has
        sent no events since it was subscribed to may cache nothing: nothing is expected of it)."""
        if not self.streaming:
            return
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:  # each page once: O(pages) over time
            when, old = self._expiries.popleft()
            for h in old:
                if self.provisional.get(h) == when:  # not renewed since
                    del self.provisional[h]
        until = now + ttl_s
        new = [h for h in hashes if h not in self.blocks]
        for h in new:
            self.provisional[h] = until
        self._expiries.append((until, new))

    def apply(self, batch: cpb.KvEventBatch) -> bool:
        """Apply one batch; False on a gap (nothing applied: the caller resubscribes)."""
        if batch.HasField("load") and batch.load.load_only:
            return True  # a load record repeating the last number: no events, no cursor
        if not batch.HasField("snapshot") and self.cursor is not None and batch.sequence_number != self.cursor:
            return False
        self.streaming = True
        # A snapshot chunk is a resync wherever it is numbered: its chunk 0 begins with a cleared event.
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                for block in event.stored.blocks:
                    self.blocks.add(block.block_hash)
                    self.provisional.pop(block.block_hash, None)
                    self.block_size = block.block_size or self.block_size
            elif kind == "removed":
                self.blocks.difference_update(event.removed.block_hashes)
                for h in event.removed.block_hashes:
                    self.provisional.pop(h, None)
            elif kind == "cleared":
                self.blocks.clear()
                self.provisional.clear()
        self.cursor = batch.sequence_number + 1
        return True


class KvIndex:
    """Per node the set of cached block hashes; `expected_hit` reads it, `sync`/`stop` run the streams."""

    def __init__(self, backoff_s: float = 0.2, backoff_max_s: float = 5.0, unimplemented_retry_s: float = 60.0):
        self.backoff_s, self.backoff_max_s, self.unimplemented_retry_s = backoff_s, backoff_max_s, unimplemented_retry_s
        self.views: dict[str, NodeView] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # job -> page size -> chain hashes; holding the job keeps its id unique while it is here
        self._memo: OrderedDict[int, tuple[GenerationJob, dict[int, list[int]]]] = OrderedDict()

    # ---- what policies read ----
    def expected_hit(self, node: NodeState, job: GenerationJob) -> int:
        """Prompt tokens of `job` that `node`'s cache holds, as far as its stream told us and the
        requests that ended there since say."""
        view = self.views.get(node.address)
        if view is None or not (view.blocks or view.provisional):
            return 0
        page = _page_size(node, view)
        run = 0
        for h in self._hashes(job, page):
            if not view.holds(h):
                break
            run += 1
        return run * page

    def expect(self, node: NodeState, job: GenerationJob, output: Sequence[int]) -> None:
        """`job` ended on `node` with `output`: a node that caches inserts its prompt and output,
        so count their whole pages as held there now (the last output token has no KV). The
        prompt's pages are the ones routing hashed; only what follows them is hashed here."""
        view = self.views.get(node.address)
        if view is None or not view.streaming:
            return
        page = _page_size(node, view)
        prompt = self._hashes(job, page)
        rest = [*job.input_ids[len(prompt) * page :], *output[:-1]]
        view.expect([*prompt, *chain_hashes(rest, page, prompt[-1] if prompt else ROOT)])

    def indexed_blocks(self) -> list[tuple[str, str, int]]:
        """(address, role, cached blocks) per followed node."""
        return [(address, view.role, len(view.blocks)) for address, view in self.views.items()]

    def _hashes(self, job: GenerationJob, page_size: int) -> list[int]:
        key = id(job)
        entry = self._memo.get(key)
        if entry is None or entry[0] is not job:
            entry = (job, {})
            self._memo[key] = entry
            if len(self._memo) > 64:  # a few requests in selection at once, retries included
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(key)
        by_size = entry[1]
        if page_size not in by_size:
            by_size[page_size] = chain_hashes(job.input_ids, page_size)
        return by_size[page_size]

    # ---- the streams (registry follower) ----
    def sync(self, states: Sequence[NodeState]) -> None:
        """Follow every node the registry knows; stop following those it forgot."""
        known = {s.address: s for s in states}
        for address, state in known.items():
            if address not in self._tasks:
                self.views[address] = NodeView(state.role)
                self._tasks[address] = asyncio.create_task(self._follow(state), name=f"kv-events {address}")
        for address in [a for a in self._tasks if a not in known]:
            self._tasks.pop(address).cancel()
            del self.views[address]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self.views.clear()

    async def _follow(self, state: NodeState) -> None:
        view = self.views[state.address]
        delay, told = self.backoff_s, False
        while True:
            if state.stub is not None:
                call = state.stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=0))
                try:
                    async for batch in call:
                        if not view.apply(batch):
                            log.info("KV events of %s skipped a batch: resubscribing", state.address)
                            break
                        delay = self.backoff_s
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                        if not told:
                            log.info("%s publishes no KV events: no cache hits are expected there", state.address)
                            told = True
                        delay = self.unimplemented_retry_s
                    else:
                        log.debug("KV events of %s: %s", state.address, e.code().name)
                finally:
                    call.cancel()
                    view.reset()  # until the next snapshot, we know nothing of it
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, max(self.backoff_max_s, delay))


def _page_size(node: NodeState, view: NodeView) -> int:
    """The page size `node`'s hashes are taken at: what it reports, else its events', else the default."""
    return node.page_size or view.block_size or DEFAULT_PAGE_SIZE
