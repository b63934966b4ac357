"""The Grafana dashboard: the committed JSON is what deploy/grafana/dashboard.py generates, and it
has the panels the issue lists, each on the dashboard's Prometheus data source variable."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.deploy.promkit import DASHBOARD, REPO

GENERATOR = REPO / "deploy" / "grafana" / "dashboard.py"


def _panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_committed_json_is_the_generators_output() -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed")
    spec = importlib.util.spec_from_file_location("pdserve_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    assert module.build() == DASHBOARD.read_text(), "run: python deploy/grafana/dashboard.py"


def test_panels_cover_the_issue_list() -> None:
    panels = _panels()
    titles = [p["title"] for p in panels]
    assert len(set(titles)) == len(titles)
    text = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in [
        "pdserve_router_requests_total",
        "pdserve_router_ttft_stage_seconds_bucket",
        "pdserve_router_time_to_first_token_seconds_bucket",
        "pdserve_router_e2e_request_latency_seconds",
        "pdserve_router_inter_token_latency_seconds",
        "pdserve_router_completion_tokens_total",
        "pdserve_router_requests_in_flight",
        "pdserve_kv_cache_usage_ratio",
        "pdserve_node_waiting_requests",
        "pdserve_pd_queue_requests",
        "pdserve_spec_accepted_tokens_total",
        "pdserve_spec_verifies_total",
        "pdserve_spec_draft_tokens_total",
        "pdserve_spec_adaptive_steps",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_failures_total",
        "pdserve_kv_handoff_tail_seconds_bucket",
        "pdserve_kv_destination_runs_bucket",
        "pdserve_router_retries_total",
        "pdserve_router_breaker_state",
        "pdserve_router_prefill_path_total",
        "pdserve_router_prefill_path_decisions_total",
        "pdserve_router_prefill_path_estimate_seconds_bucket",
        "pdserve_router_ttft_estimate_ratio",
        "pdserve_router_prefill_demand_tokens_per_second",
        "pdserve_router_prefill_capacity_tokens_per_second",
        "pdserve_router_decode_demand_tokens_per_second",
        "pdserve_router_decode_capacity_tokens_per_second",
        "pdserve_router_balanced_prefill_decode_ratio",
        "pdserve_router_nodes_needed",
        "pdserve_router_pd_pooled",
        "pdserve_router_tier_load",
        "pdserve_router_pd_pool_switches_total",
    ]:
        assert metric in text, metric
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    assert dash["uid"] == "pdserve"


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    import yaml

    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.startswith("./grafana/pdserve.json:") for m in mounts)
    ds = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    assert Path(DASHBOARD).stat().st_size > 0
