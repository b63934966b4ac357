"""Rendering the Helm chart offline (helm-python-sdk bundles the Helm Go SDK) for the chart tests."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdserve"
GPU_VALUES = CHART / "values-gpu-rdma.yaml"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBE_VERSION = "1.31.0"  # one Kubernetes version for lint and schema validation
RELEASE, NAMESPACE = "llm", "serving"

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install '.[test]')")


def values_file(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


@lru_cache(maxsize=8)
def _render(values_json: str) -> tuple[tuple[str, str], ...]:
    out = helm.Chart.load(str(CHART)).render(
        json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    return tuple(sorted(out.items()))


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """{template path: rendered text}, as `helm template` would print them."""
    return dict(_render(json.dumps(values or {}, sort_keys=True)))


def objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders (NOTES.txt left out)."""
    out: list[dict[str, Any]] = []
    for path, text in render(values).items():
        if path.endswith(".yaml"):
            out += [o for o in yaml.safe_load_all(text) if o]
    return out


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
    return found[0]


def containers(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from obj["spec"]["template"]["spec"]["containers"]


def flag(args: list[str], name: str) -> list[str]:
    """Values of `--name=value` and `--name value` in an argv list."""
    vals = []
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            vals.append(a.split("=", 1)[1])
        elif a == name and i + 1 < len(args):
            vals.append(args[i + 1])
    return vals


def cli_params(args: list[str]) -> dict[str, Any]:
    """What the real `pdserve` command line makes of a container's args (a flag it does not have,
    or a value of the wrong type, raises click's UsageError)."""
    import typer.main

    from pdserve.cli import app

    command = typer.main.get_command(app).commands[args[0]]  # type: ignore[attr-defined]
    return command.make_context(args[0], list(args[1:])).params
