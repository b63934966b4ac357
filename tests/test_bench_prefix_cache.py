"""bench/prefix_cache.py end to end on this CPU (the built-in pair, EAGLE on, colocated, --quick):
cache on and off each a real `pdserve up`, the JSON's layout, reuse reported, acceptance unchanged."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.prefix_cache import main, ratios

pytestmark = pytest.mark.slow


def test_ratios_compare_the_cache_with_its_absence():
    run = lambda ttft, reuse, acc, tput: {  # noqa: E731
        "multi_turn": {
            "by_turn": {"3+": {"ttft_ms_p50": ttft}},
            "prefix_cache": {"reuse_ratio": reuse},
            "accept_length": acc,
        },
        "no_reuse": {"output_throughput": tput},
    }
    got = ratios(run(20.0, 0.95, 3.0, 990.0), run(80.0, None, 3.0, 1000.0))
    assert got == {
        "ttft_p50_turn3plus_speedup": 4.0,
        "reuse_ratio": 0.95,
        "accept_length_ratio": 1.0,
        "no_reuse_throughput_ratio": 0.99,
    }


def test_prefix_cache_bench_on_cpu(tmp_path):
    try:
        assert main(["--out", str(tmp_path), "--quick", "--deployments", "colocated", "--log-dir", str(tmp_path)]) == 0
    finally:  # every deployment should be down already; never leave one behind
        subprocess.run(["pkill", "-f", "pdserve.cli up --port 0 --verbose --colocated"], timeout=10, check=False)
    data = json.loads((tmp_path / "prefix_cache_cpu.json").read_text())
    runs = data["deployments"]["colocated"]
    for state in ("cache", "no_cache"):
        multi = runs[state]["multi_turn"]
        assert multi["failed"] == 0 and multi["requests"] == data["sizes"]["conversations"] * data["sizes"]["turns"]
        assert {"1", "2", "3+"} <= set(multi["by_turn"]) and multi["accept_length"] > 1  # EAGLE drafts accepted
        stages = multi["ttft_stages_ms"]  # where the first tokens' time went, router and node
        router = stages['pdserve_router_ttft_stage{stage="prefill"}']
        assert router >= stages['pdserve_node_prompt{role="colocated"}'] > 0
        # the router's whole TTFT, from the request's arrival: its stages and its own parsing
        assert stages['pdserve_router_time_to_first_token{endpoint="/v1/completions"}'] >= router
        assert multi["paths"] == {"colocated": multi["requests"]}  # the router's requests by path
        plain = runs[state]["no_reuse"]  # the no-reuse run's own paths and stages
        assert plain["paths"] == {"colocated": data["sizes"]["no_reuse_prompts"]}
        assert plain["stages_ms"]['pdserve_node_prompt{role="colocated"}'] > 0
    assert runs["cache"]["multi_turn"]["prefix_cache"]["reuse_ratio"] >= 0.8
    assert runs["no_cache"]["multi_turn"]["prefix_cache"]["cached_tokens"] == 0
    assert runs["ratios"]["accept_length_ratio"] == pytest.approx(1.0)
