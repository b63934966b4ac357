"""Prometheus metrics of PD nodes: transfer bytes/latency, failures by reason, bootstrap attempts,
and engine gauges, scraped from the nodes' /metrics and parsed as valid exposition."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.kv_transfer import nixl_available
from fixtures.pdkit import pd_generate, request, start_pair, stub, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_transfer_metrics_and_failure_reasons(tiny_llama_dir):
    prefill, decode = start_pair(str(tiny_llama_dir), "--metrics-port", "0", decode_extra=("--waiting-timeout", "2"))
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        got, _ = pd_generate(p, d, request("ok", [5, 6, 7, 8, 9], 1, boot))
        assert len(got[-1].complete.output_ids) == 16
        with pytest.raises(grpc.RpcError) as e:  # the prefill leg never comes: decode times out
            list(d.Generate(request("orphan", [5, 6, 7], 2, boot), timeout=20))
        assert "no KV from the prefill within 2 s" in e.value.details()
        wait_idle(d)
        pm, dm = scrape(prefill.ports["metrics"]), scrape(decode.ports["metrics"])
        role = lambda r: (("role", r),)  # noqa: E731
        assert pm[("pdserve_kv_transfer_bytes_total", role("prefill"))] > 0
        assert pm[("pdserve_kv_transfer_seconds_count", role("prefill"))] == 1
        assert (
            dm[("pdserve_kv_transfer_bytes_total", role("decode"))]
            == pm[("pdserve_kv_transfer_bytes_total", role("prefill"))]
        )
        assert dm[("pdserve_kv_transfer_failures_total", (("reason", "waiting_timeout"), ("role", "decode")))] == 1
        assert dm[("pdserve_bootstrap_attempts_total", (("result", "ok"),))] == 1
        # both rooms got a destination; a fresh pool gives each one run of pages
        assert dm[("pdserve_kv_destination_runs_count", ())] == 2 and dm[("pdserve_kv_destination_runs_sum", ())] == 2
        # the one write of the prompt that ran: one run, consecutive on both sides
        final = (("kind", "final"),)
        assert pm[("pdserve_kv_write_runs_count", final)] == 1 and pm[("pdserve_kv_write_runs_sum", final)] == 1
        assert dm[("pdserve_kv_cache_used_tokens", role("decode"))] == 0
        assert dm[("pdserve_kv_cache_capacity_tokens", role("decode"))] > 0
    finally:
        prefill.kill()
        decode.kill()
