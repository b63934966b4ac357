"""Finding (or installing) Debian's prometheus + promtool, and the dashboard's queries, for tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
RULE_FILES = sorted((PROM_DIR / "rules").glob("*.yml"))
DASHBOARD = REPO / "deploy" / "grafana" / "pdserve.json"
APT_TIMEOUT_S = 600


def _install_with_apt() -> str:
    """Why apt could not install prometheus, or "" once it did."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=APT_TIMEOUT_S, env=env, check=False)
            if r.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {r.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
        return f"apt-get took over {APT_TIMEOUT_S} s"
    return ""


def binary(name: str) -> str:
    """Path of `prometheus` or `promtool`; installs Debian's package when missing, else skips."""
    path = shutil.which(name)
    if path is None:
        why = _install_with_apt()
        path = shutil.which(name)
        if path is None:
            pytest.skip(f"{name} not found and Debian's prometheus package could not be installed: {why}")
    return path


def dashboard_queries(window: str = "5m") -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target, Grafana's $__rate_interval made concrete."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        (p["title"], t["expr"].replace("$__rate_interval", window))
        for p in panels
        if p["type"] != "row"
        for t in p["targets"]
    ]


def recording_rules() -> list[str]:
    import yaml

    return [
        r["record"]
        for f in RULE_FILES
        for g in yaml.safe_load(f.read_text())["groups"]
        for r in g["rules"]
        if "record" in r
    ]
