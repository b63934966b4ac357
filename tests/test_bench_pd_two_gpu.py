"""The transport-vs-raw-NIXL bandwidth probe of the two-GPU PD benchmark runs on CPU (UCX over
host memory), small: both numbers and their ratio come out (speed itself is judged on the GPU)."""

from __future__ import annotations

import pytest

from engine.kv_transfer import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")


def test_kv_bandwidth_probe_on_cpu():
    from bench.gpu import kv_bandwidth

    out = kv_bandwidth.measure("cpu", "cpu", (32, 64))
    assert set(out) == {"32", "64"}
    for row in out.values():
        assert row["kv_bytes"] == int(row["kv_bytes"]) > 0 and row["kv_plus_row_bytes"] > row["kv_bytes"]
        assert row["ours_gb_s"] > 0 and row["raw_nixl_gb_s"] > 0
        assert row["ratio_vs_raw"] > 0
