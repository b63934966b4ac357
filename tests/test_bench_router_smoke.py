"""bench.router_overhead --quick end to end: fake instant nodes + the real router process, short run."""

from __future__ import annotations

import time

import pytest

from bench.router_overhead import MAX_TOKENS, format_tables, run

pytestmark = pytest.mark.slow  # a real router process and node processes


def test_router_overhead_quick_smoke() -> None:
    start = time.perf_counter()
    report = run(quick=True)
    # ~7 s on the idle 2-core dev box (two child processes start); budget 30 s
    assert time.perf_counter() - start < 30
    lat = report["latency"]
    for key in ("router_ttft", "router_e2e", "direct_ttft", "direct_e2e", "health"):
        assert lat[key]["n"] == report["latency_n"] and lat[key]["p99_ms"] >= lat[key]["p50_ms"] > 0
    assert lat["router_e2e"]["p50_ms"] >= lat["router_ttft"]["p50_ms"]
    assert [(r["path"], r["concurrency"]) for r in report["throughput"]] == [("router", 8), ("direct", 8)]
    for r in report["throughput"]:
        assert r["errors"] == 0 and r["requests"] > 0 and r["req_s"] > 0
        assert r["tok_s"] == pytest.approx(r["req_s"] * MAX_TOKENS)  # every request streamed all its tokens
        assert r["cpu_pct"]["nodes"] > 0 and r["cpu_pct"]["client"] > 0
    router = report["throughput"][0]
    assert router["cpu_pct"]["router"] > 0 and router["router_cpu_ms_per_req"] > 0
    assert format_tables(report).startswith("| sequential streaming request")
