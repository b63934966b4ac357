"""A node's prefix cache seen from outside: `cached_tokens` on the SGLang worker API (streamed and
final), the hit rate in GetLoads, the cache's metrics; `--disable-radix-cache` turns it off."""

from __future__ import annotations

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from fixtures.pdkit import local_request, stub
from fixtures.procs import Node
from tests.pd.test_pd_metrics import scrape

pytestmark = pytest.mark.slow
HISTORY = list(range(10, 47))  # 37 tokens: 9 whole pages of 4


def _complete(s, rid: str, ids: list[int], stream: bool = False):
    return list(s.Generate(local_request(rid, ids, max_new=8, stream=stream), timeout=60))


@pytest.mark.parametrize(
    "disabled, warmup", [(False, False), (True, False), (False, True)], ids=["cache", "disabled", "warmed-up"]
)
def test_a_follow_up_reports_its_cached_prompt_tokens(tiny_llama_dir, disabled, warmup):
    """A node warmed up at start (engine/warmup.py) reports its prompt rate before any request,
    and counts, caches and reports exactly what a cold one does."""
    flags = (["--disable-radix-cache"] if disabled else []) + (["--warmup"] if warmup else [])
    node = Node(
        ["serve", "--model", str(tiny_llama_dir), "--port", "0", "--page-size", "4", "--metrics-port", "0", *flags]
    ).wait_ready()
    try:
        s = stub(node.ports["scheduler"])
        perf = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args["perf"]
        assert (perf["prefill_tokens_per_s"] > 0) == warmup
        first = _complete(s, "t1", HISTORY)[-1].complete
        assert first.cached_tokens == 0
        follow = HISTORY + list(first.output_ids) + [3, 1, 4]
        streamed = _complete(s, "t2", follow, stream=True)
        done = streamed[-1].complete
        want = 0 if disabled else 44  # 11 whole pages of the 45-token history (the first turn's prompt and reply)
        assert done.cached_tokens == want and done.prompt_tokens == len(follow)
        assert all(r.chunk.cached_tokens == want for r in streamed if r.HasField("chunk"))
        load = s.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
        assert load.cache_hit_rate == pytest.approx(want / (len(HISTORY) + len(follow)))
        assert load.num_used_tokens == 0  # cached pages nobody reads count as free
        m = scrape(node.ports["metrics"])
        role = (("role", "colocated"),)
        assert m[("pdserve_node_cached_prompt_tokens_total", role)] == want
        assert m[("pdserve_node_admitted_prompt_tokens_total", role)] == len(HISTORY) + len(follow)
        assert m[("pdserve_node_cached_prompt_tokens_per_request_count", role)] == 2
        assert (("pdserve_prefix_cache_pages", role) in m) == (not disabled)
        if not disabled:
            assert m[("pdserve_prefix_cache_pages", role)] >= 11
            assert m[("pdserve_prefix_cache_evictable_pages", role)] == m[("pdserve_prefix_cache_pages", role)]
    finally:
        node.kill()
