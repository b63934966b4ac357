"""Prometheus assets checked with promtool: the rules parse, every alert has passing unit tests,
the local stack's scrape config is valid, and every dashboard query parses as PromQL."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.deploy.promkit import PROM_DIR, RULE_FILES, binary, dashboard_queries

TIMEOUT_S = 120


def _promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def test_rules_parse() -> None:
    r = _promtool("check", "rules", *map(str, RULE_FILES))
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_unit_tests_pass_and_cover_every_alert() -> None:
    tests = PROM_DIR / "tests" / "alerts-test.yml"
    r = _promtool("test", "rules", str(tests))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    alerts = {
        rule["alert"]
        for f in RULE_FILES
        for g in yaml.safe_load(f.read_text())["groups"]
        for rule in g["rules"]
        if "alert" in rule
    }
    cases = yaml.safe_load(tests.read_text())["tests"]
    fired = {t["alertname"] for c in cases for t in c.get("alert_rule_test", []) if t["exp_alerts"]}
    quiet = {t["alertname"] for c in cases for t in c.get("alert_rule_test", []) if not t["exp_alerts"]}
    assert alerts == fired == quiet, (alerts, fired, quiet)
    assert {
        "PdserveRouterHigh5xxRatio",
        "PdserveTTFTP99AboveSLO",
        "PdserveKVTransferFailures",
        "PdserveNoReadyPair",
        "PdserveKVCacheNearlyFull",
        "PdserveSpecAcceptanceDropPD",
    } <= alerts


def test_local_stack_scrape_config_is_valid() -> None:
    r = _promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """Written as recording rules so promtool's parser checks each expression (a missing `)`
    or a bad matcher fails here, not in Grafana)."""
    queries = dashboard_queries()
    assert len(queries) >= 25
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query_{i}", "expr": q} for i, (_, q) in enumerate(queries)],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = _promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
