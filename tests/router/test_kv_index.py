"""The router's KV index: one node's view from its batches (gaps, snapshots, load records) and the
pages it is expected to hold before its events say so, and the streams against fake nodes:
resubscribing from a snapshot after a gap, nodes that publish nothing, followers stopped with the
registry; the routed request's expected hit as a metric; a request's pages counted on the node it
ended on before that node's events arrive."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from smg_grpc_proto.generated import common_pb2 as cpb

from common.prefix_hash import chain_hashes
from router.kv_index import KvIndex, NodeView
from router.metrics import CacheRouteMetrics
from router.nodes import NodeRegistry
from tests.router.fake_nodes import HANG_S, FakeNode, cluster, collect, dispatcher, job, run, until

PS = 4
HISTORY = tuple(range(100, 120))  # 5 pages of 4


def stored(ids, first: int = 0, parent: int | None = None) -> cpb.KvCacheEvent:
    """The stored event of `ids`' whole pages from page `first` on."""
    hashes = chain_hashes(ids, PS)
    blocks = [
        cpb.KvBlock(block_hash=h, token_ids=ids[i * PS : (i + 1) * PS], block_size=PS)
        for i, h in enumerate(hashes)
        if i >= first
    ]
    return cpb.KvCacheEvent(stored=cpb.KvBlocksStored(blocks=blocks, parent_block_hash=parent))


def batch(seq: int, *events: cpb.KvCacheEvent) -> cpb.KvEventBatch:
    return cpb.KvEventBatch(sequence_number=seq, events=events)


def snapshot(seq: int, *events: cpb.KvCacheEvent) -> cpb.KvEventBatch:
    cleared = cpb.KvCacheEvent(cleared=cpb.KvCacheCleared())
    chunk = cpb.KvSnapshotChunk(index=0, count=1)
    return cpb.KvEventBatch(sequence_number=seq, events=[cleared, *events], snapshot=chunk)


def removed(ids, first: int) -> cpb.KvCacheEvent:
    return cpb.KvCacheEvent(removed=cpb.KvBlocksRemoved(block_hashes=chain_hashes(ids, PS)[first:]))


def test_a_view_applies_batches_in_order_and_resyncs_on_snapshots():
    v = NodeView("prefill")
    assert v.apply(batch(7, stored(HISTORY[:8])))  # a fresh subscription takes whatever comes first
    assert v.apply(batch(8, stored(HISTORY, first=2)))
    assert v.blocks == set(chain_hashes(HISTORY, PS)) and v.block_size == PS
    assert v.apply(batch(9, removed(HISTORY, 3)))
    assert v.blocks == set(chain_hashes(HISTORY, PS)[:3])
    load = cpb.KvEventBatch(sequence_number=9, load=cpb.EngineLoad(load_only=True))
    assert v.apply(load) and v.cursor == 10  # a load record numbers nothing
    assert not v.apply(batch(11, removed(HISTORY, 0)))  # a gap: nothing applied
    assert len(v.blocks) == 3
    assert v.apply(snapshot(4, stored(HISTORY[:4])))  # a resync, numbered wherever
    assert v.blocks == {chain_hashes(HISTORY, PS)[0]} and v.cursor == 5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_expected_pages_count_until_the_events_confirm_remove_or_outlive_them():
    clock = Clock()
    v = NodeView("decode", clock)
    hashes = chain_hashes(HISTORY, PS)
    v.expect(hashes)
    assert not v.provisional  # no events since it was subscribed to: it may cache nothing
    assert v.apply(snapshot(0))
    v.expect(hashes[:4])
    assert all(v.holds(h) for h in hashes[:4]) and not v.holds(hashes[4])
    assert v.apply(batch(1, stored(HISTORY[:8])))  # confirmed: the events' own from now on
    assert v.blocks == set(hashes[:2]) and set(v.provisional) == set(hashes[2:4])
    assert v.apply(batch(2, removed(HISTORY, 3)))  # the node evicted one it never confirmed
    assert set(v.provisional) == {hashes[2]}
    clock.now += 2.5  # the node never said so: forgotten
    assert not v.holds(hashes[2]) and v.holds(hashes[0])
    v.expect(hashes[:1])  # expired entries go as new ones come
    assert v.provisional == {}
    v.expect(hashes[2:5])
    clock.now += 1.5
    v.expect(hashes[4:5])  # the same page again (a second request ended there): it lasts longer
    clock.now += 1.0
    v.expect([])  # the first expectations' time is up, the renewed page's is not
    assert set(v.provisional) == {hashes[4]} and v.holds(hashes[4]) and not v.holds(hashes[3])
    v.expect(hashes)
    v.reset()  # a broken stream: nothing is known of it until the next snapshot
    assert not v.provisional and not v.streaming


def test_a_follow_up_finds_its_history_on_the_node_its_last_turn_ended_on():
    """The node's events lag its insert by its flush interval; a chat client's next turn comes at
    once, and must still see the turn before it (prompt and reply) where it ended."""
    prompt = HISTORY[:10]

    async def main() -> None:
        node = EventNode([[snapshot(0)]])  # a cache that stays silent after its first snapshot
        async with cluster(node) as registry:
            index = KvIndex(backoff_s=0.01)
            index.sync(registry.nodes("colocated"))
            try:
                state = registry.get(node.address)
                await until(lambda: index.views[node.address].streaming)
                follow_up = job("turn-2", ids=prompt + (11, 12, 13) + (7,) * 8)
                assert index.expected_hit(state, follow_up) == 0
                events = await collect(dispatcher(registry, kv_index=index), job("turn-1", ids=prompt))
                assert [t for e in events[:-1] for t in e.token_ids] == [11, 12, 13]
                # prompt and output but the last token (no KV): 12 tokens, 3 whole pages of 4
                assert index.expected_hit(state, follow_up) == 12
            finally:
                await index.stop()

    run(main())


class EventNode(FakeNode):
    """A fake node whose KV event streams play `scripts`, one per subscription, then stay open."""

    def __init__(self, scripts: list[list[cpb.KvEventBatch]]) -> None:
        super().__init__("colocated")
        self.scripts, self.subscriptions = scripts, []

    async def SubscribeKvEvents(self, request, context):
        self.subscriptions.append(request.start_sequence_number)
        for b in self.scripts.pop(0) if self.scripts else []:
            yield b
        await asyncio.sleep(HANG_S)

    async def GetServerInfo(self, request, context):
        info = await super().GetServerInfo(request, context)
        info.server_args.update({"page_size": PS})  # as pdserve nodes report it
        return info


def test_the_index_follows_a_node_and_resubscribes_after_a_gap():
    first = [snapshot(3, stored(HISTORY[:12])), batch(4, stored(HISTORY, first=3)), batch(6, removed(HISTORY, 0))]
    second = [snapshot(6, stored(HISTORY[:8]))]

    async def main() -> None:
        node = EventNode([first, second])
        await node.start()
        index = KvIndex(backoff_s=0.01)
        registry = NodeRegistry([node.spec], rpc_timeout_s=2.0, followers=[index])
        try:
            await registry.refresh_once()
            state = registry.get(node.address)
            assert state.page_size == PS
            # after the gap (6 after 4) the index starts over from 0: the second snapshot
            await until(
                lambda: node.subscriptions == [0, 0] and index.indexed_blocks() == [(node.address, "colocated", 2)]
            )
            assert index.expected_hit(state, job(ids=HISTORY + (1, 2))) == 8
            assert index.expected_hit(state, job(ids=HISTORY[:4] + (0,) * 8)) == 4
            assert index.expected_hit(state, job(ids=(0,) + HISTORY)) == 0
            state.page_size = 2  # the page size the node reports is the one hashed with (here: no match)
            assert index.expected_hit(state, job(ids=HISTORY)) == 0
        finally:
            await registry.stop()
            await node.stop()
        assert index.indexed_blocks() == [] and not index._tasks

    run(main())


def test_a_node_without_events_holds_nothing_and_the_hit_is_a_metric():
    async def main() -> None:
        node = FakeNode("colocated")  # the generated servicer answers UNIMPLEMENTED
        await node.start()
        index = KvIndex(backoff_s=0.01, unimplemented_retry_s=0.05)
        registry = NodeRegistry([node.spec], rpc_timeout_s=2.0, followers=[index])
        try:
            await registry.refresh_once()
            await asyncio.sleep(0.2)  # several attempts, each refused
            state = registry.get(node.address)
            assert state.healthy and index.expected_hit(state, job(ids=HISTORY)) == 0
            metrics = CollectorRegistry()
            m = CacheRouteMetrics(metrics, index)
            m.expected_hit.observe(index.expected_hit(state, job(ids=HISTORY)))
            text = generate_latest(metrics).decode()
            assert f'pdserve_router_indexed_kv_blocks{{node="{node.address}",role="colocated"}} 0.0' in text
            assert 'pdserve_router_expected_cache_hit_tokens_bucket{le="0.0"} 1.0' in text
        finally:
            await registry.stop()
            await node.stop()

    run(main())
