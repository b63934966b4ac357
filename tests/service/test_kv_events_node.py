"""A node publishes its prefix cache: SubscribeKvEvents streams the pages a request left cached
(their hashes are the router's chain hashes of its tokens) and the pages FlushCache dropped; a
late subscriber starts from a snapshot; a node without a cache answers UNIMPLEMENTED."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb

from common.prefix_hash import chain_hashes
from fixtures.pdkit import local_request, stub
from fixtures.procs import Node

pytestmark = pytest.mark.slow
PROMPT = list(range(10, 47))  # 37 tokens: 9 whole pages of 4


class Follower:
    """One subscription, read on a thread; `view` is the set of hashes its events leave cached."""

    def __init__(self, port: int, start: int = 0) -> None:
        self.call = stub(port).SubscribeKvEvents(cpb.SubscribeKvEventsRequest(start_sequence_number=start))
        self.batches: queue.Queue = queue.Queue()
        self.view: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for b in self.call:
                self.batches.put(b)
        except grpc.RpcError as e:
            self.batches.put(e)

    def until(self, done, timeout: float = 20.0) -> None:
        """Apply batches until `done(view)`."""
        while not done(self.view):
            b = self.batches.get(timeout=timeout)
            if isinstance(b, Exception):
                raise b
            for e in b.events:
                kind = e.WhichOneof("data")
                if kind == "cleared":
                    self.view.clear()
                elif kind == "stored":
                    self.view.update(x.block_hash for x in e.stored.blocks)
                else:
                    self.view.difference_update(e.removed.block_hashes)


def test_a_request_stores_pages_and_flush_removes_them(tiny_llama_dir):
    node = Node(["serve", "--model", str(tiny_llama_dir), "--port", "0", "--page-size", "4"]).wait_ready()
    try:
        port = node.ports["scheduler"]
        s = stub(port)
        early = Follower(port)
        early.until(lambda v: True)  # the snapshot of the empty cache
        out = list(s.Generate(local_request("k1", PROMPT, max_new=8), timeout=60))[-1].complete
        history = PROMPT + list(out.output_ids)
        # the prompt and its reply, as far as their KV was computed (the last token's never is)
        want = set(chain_hashes(history[:-1], 4))
        early.until(lambda v: v >= set(chain_hashes(PROMPT, 4)))
        early.until(lambda v: v == want)
        late = Follower(port)  # a snapshot brings it to the same state
        late.until(lambda v: v == want)
        flushed = s.FlushCache(cpb.FlushCacheRequest(), timeout=10)
        assert flushed.success and f"flushed {len(want)}" in flushed.message
        early.until(lambda v: not v)
        late.until(lambda v: not v)
        early.call.cancel()
        late.call.cancel()
    finally:
        node.kill()


def test_a_node_without_a_cache_publishes_nothing(tiny_llama_dir):
    args = ["serve", "--model", str(tiny_llama_dir), "--port", "0", "--disable-radix-cache"]
    node = Node(args).wait_ready()
    try:
        port = node.ports["scheduler"]
        with pytest.raises(grpc.RpcError) as e:
            Follower(port).until(lambda v: False)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert stub(port).FlushCache(cpb.FlushCacheRequest(), timeout=10).success
    finally:
        node.kill()
