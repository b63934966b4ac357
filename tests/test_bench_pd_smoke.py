"""bench.pd_cpu part 1 (a real two-process NIXL write vs in-process copies) at a tiny size.

Only the transfer half runs here (no nodes are started): both progress-thread settings, two
request sizes, two timed repetitions each. Skipped when nixl-cu13 is not installed.
"""

from __future__ import annotations

import time

import pytest

from engine.kv_transfer import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")
# 2 layers x (K, V) = 4 regions of 4-token pages, 256 bytes each (fp16).
TINY = {"layers": 2, "page_size": 4, "kv_heads": 2, "head_dim": 16}


def test_pd_cpu_transfer_quick_smoke() -> None:
    import nixl_cu13._api as api

    from bench.pd_cpu import format_tables, run

    start = time.perf_counter()
    report = run(quick=True, e2e=False, transfer_tokens=(16, 64), pool_shape=TINY, reps=2)
    # ~8 s on the idle 2-core dev box (two reader processes); slack for a busy shared host
    assert time.perf_counter() - start < 60
    rows = report["transfer"]
    assert [(r["prog_thread"], r["tokens"]) for r in rows] == [(True, 16), (True, 64), (False, 16), (False, 64)]
    for r in rows:
        assert r["nixl_gb_s"] > 0 and r["memcpy_gb_s"] > 0 and r["index_copy_gb_s"] > 0 and r["ratio"] > 0
        assert len(r["handoff_s"]) == len(r["memcpy_s"]) == 2  # the warm-up is dropped
        assert r["handoff_p90_ms"] >= r["handoff_p50_ms"] > 0
        assert r["kv_bytes"] == r["pages"] * r["regions"] * 4 * 2 * 16 * 2 and r["regions"] == 4
    # the progress-thread switch is scoped: agents made afterwards get NIXL's default again
    assert api.nixl_agent_config().enable_pthread is True
    assert "e2e" not in report and format_tables(report).startswith("| request")
