"""Cache-aware routing end to end: a router with prefix_aware over two colocated nodes follows
their KV events and sends each conversation's next turn to the node that holds its history,
whose prefix cache then serves it."""

from __future__ import annotations

import json
import urllib.request

import pytest

from fixtures.procs import Node
from fixtures.waiting import wait_until
from tests.pd.test_pd_metrics import scrape

pytestmark = pytest.mark.slow
PAGE = 4


def _complete(url: str, ids: list[int]) -> dict:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _cached(resp: dict) -> int:
    return (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _indexed(port: int) -> dict[str, float]:
    return {dict(k[1])["node"]: v for k, v in scrape(port).items() if k[0] == "pdserve_router_indexed_kv_blocks"}


def test_follow_up_turns_go_to_the_node_holding_their_history(tiny_llama_dir):
    nodes = [Node(["serve", "--model", str(tiny_llama_dir), "--port", "0", "--page-size", str(PAGE)]) for _ in range(2)]
    router = None
    try:
        addrs = [f"127.0.0.1:{n.wait_ready(120).ports['scheduler']}" for n in nodes]
        args = ["router", "--port", "0", "--served-model", "tiny", "--decode-policy", "prefix_aware"]
        router = Node(args + [x for a in addrs for x in ("--colocated", a)]).wait_ready(60)
        port = router.ports["http"]
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: set(_indexed(port)), 20, "the router follows both nodes", lambda got: got == set(addrs))
        # four conversations of 40-token first turns (10 pages each): too short for the cold-prefix
        # hash, so least-load spreads them over both nodes
        firsts = [[100 + 7 * c + i for i in range(40)] for c in range(4)]
        for ids in firsts:
            assert _cached(_complete(url, ids)) == 0
        wait_until(lambda: sum(_indexed(port).values()), 20, "the first turns are indexed", lambda n: n >= 40)
        assert all(v > 0 for v in _indexed(port).values()), "both nodes served a first turn"
        # the next turn reuses the whole first prompt; in reverse order, so that least-load's
        # rotation would send every one of them to the other node
        for c, ids in reversed(list(enumerate(firsts))):
            assert _cached(_complete(url, ids + [3, 1, 4, 1, 5])) == 40, c
        hits = {k[0]: v for k, v in scrape(port).items() if k[0].startswith("pdserve_router_expected_cache_hit")}
        assert hits["pdserve_router_expected_cache_hit_tokens_sum"] == 4 * 40
    finally:
        for n in [*nodes, router]:
            if n is not None:
                n.kill()
