"""A pooled PD deployment end to end on loopback (router/pooling.py): real prefill and decode nodes
(the built-in pair, EAGLE on, KV over NIXL) behind a router with `--pd-pooling always`, which
sends every request whole to the prefill node or locally to the decode node, and a second router
over the same nodes with every prompt on the prefill node. Greedy completions are the same through
both, the pooled router used both nodes and no PD pair, and every page returns to both pools."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.kv_transfer import nixl_available
from fixtures.procs import Node
from tests.router.stack import running_stack, wait_status

pytestmark = [
    pytest.mark.slow,  # real node processes
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed"),
]

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n\n\ndef walk(root):"]


def complete(url: str, prompt: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    return _post(f"{url}/v1/completions", body)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def router_samples(url: str, family: str) -> dict[str, float]:
    """A router metric family's `_total` (or plain) samples by their one label's value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    return {next(iter(s.labels.values()), ""): s.value for s in families[family].samples if "_created" not in s.name}


def test_pooled_requests_run_whole_or_local_and_equal_the_split() -> None:
    router_args = ("--pd-prefill-policy", "auto", "--pd-pooling", "always", "--decode-policy", "least_load")
    with running_stack(
        None, decodes=1, router_args=router_args, prefill_args=("--local-decode-tpot-ms", "25")
    ) as stack:
        assert router_samples(stack.url, "pdserve_router_pd_pooled")[""] == 1.0
        pooled = [complete(stack.url, p) for p in PROMPTS for _ in range(2)]
        split_router = Node(
            [
                "router",
                "--port",
                "0",
                "--prefill",
                f"127.0.0.1:{stack.prefill.ports['scheduler']},{stack.prefill.ports['bootstrap']}",
                "--decode",
                f"127.0.0.1:{stack.decodes[0].ports['scheduler']}",
                "--pd-prefill-policy",
                "remote",
            ]
        )
        try:
            split_router.wait_ready(60)
            split_url = f"http://127.0.0.1:{split_router.ports['http']}"
            wait_status(f"{split_url}/ready", 200, 60)
            split = [complete(split_url, p) for p in PROMPTS for _ in range(2)]
            split_paths = router_samples(split_url, "pdserve_router_prefill_path")
        finally:
            split_router.kill()
        assert [c["choices"][0]["text"] for c in pooled] == [c["choices"][0]["text"] for c in split]
        assert all(c["choices"][0]["finish_reason"] == "length" for c in pooled)
        paths = router_samples(stack.url, "pdserve_router_prefill_path")
        # least-load between two idle nodes rotates (reported loads lag a refresh): both served some
        assert paths["whole"] >= 1 and paths["local"] >= 1 and paths["remote"] == 0
        served = paths["whole"] + paths["local"]  # the six, and the readiness probe's
        assert (
            served >= len(pooled)
            and router_samples(stack.url, "pdserve_router_prefill_path_decisions")["pooled"] == served
        )
        assert split_paths["remote"] >= len(split) and split_paths["whole"] == split_paths["local"] == 0
        stack.wait_all_idle()
