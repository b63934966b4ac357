"""The transport-vs-raw-NIXL bandwidth probe of the two-GPU PD benchmark runs on CPU (UCX over
host memory), small: both numbers and their ratio come out, for writes posted per descriptor and
as one scatter-gather list (speed itself is judged on the GPU)."""

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
        assert set(row["raw_nixl_gb_s_by_descriptors"]) == {"1", "4", "16", "64"}
        assert set(row["raw_nixl_sgl_gb_s_by_descriptors"]) == {"1", "64"}
        assert row["raw_nixl_gb_s"] == max(
            *row["raw_nixl_gb_s_by_descriptors"].values(), *row["raw_nixl_sgl_gb_s_by_descriptors"].values()
        )
        assert row["ours_sgl_gb_s"] > 0 and row["ratio_sgl_vs_raw"] > 0


def test_stage_means_are_per_observation_between_scrapes():
    from bench.gpu.pd_two_gpu import stage_means_ms

    before = {'router:x{stage="prefill"}': (1.0, 4.0), "decode-0:y": (2.0, 1.0)}
    after = {'router:x{stage="prefill"}': (1.5, 6.0), "decode-0:y": (2.0, 1.0), "prefill-0:z": (0.003, 1.0)}
    assert stage_means_ms(before, after) == {'router:x{stage="prefill"}': 250.0, "prefill-0:z": 3.0}


def test_one_requests_ttft_and_forward_come_from_the_real_metrics_between_two_scrapes():
    """The router's TTFT (summed over its endpoints, first tokens only), the node's prompt time and
    its prompt launches of the one request between two scrapes, the router's from its real text."""
    from prometheus_client import CollectorRegistry, generate_latest

    from bench.gpu.pd_two_gpu import request_times_ms, stage_sums
    from router.metrics import RouterMetrics

    scrape = lambda text: stage_sums("router", text)  # noqa: E731
    metrics = RouterMetrics(CollectorRegistry(auto_describe=True))
    metrics.observe_tokens("completions", 1, 0.0, True, 0.25)
    before = scrape(generate_latest(metrics.registry).decode())
    metrics.observe_tokens("chat", 1, 0.0, True, 0.5)
    metrics.observe_tokens("chat", 2, 0.1, False, 0.7)  # not a first token
    after = scrape(generate_latest(metrics.registry).decode())
    node = 'prefill-0:pdserve_node_prompt_seconds{role="prefill"}'
    before[node], after[node] = (1.0, 3.0), (1.04, 4.0)
    for kind, (was, now) in {"prompt": (0.5, 0.53), "decode": (2.0, 2.5)}.items():
        key = f'prefill-0:pdserve_node_launch_seconds{{role="prefill",kind="{kind}"}}'
        before[key], after[key] = (was, 1.0), (now, 2.0)
    times = request_times_ms(before, after)
    assert times == pytest.approx({"ttft": 500.0, "forward": 40.0, "launch": 30.0})
