"""The Helm chart: strict lint, every rendered object schema-validated (Kubernetes 1.31 strict,
vendored CRD schemas), values.schema.json rejecting bad values, and the pods' security settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chartkit import CHART, GPU_VALUES, KUBE_VERSION, SCHEMAS, by_kind, containers, helm, objects
from tests.deploy.chartkit import render, values_file

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
jsonschema = pytest.importorskip("jsonschema")

CRD_SCHEMAS = {
    "ServiceMonitor": "servicemonitor.json",
    "PodMonitor": "podmonitor.json",
    "ScaledObject": "scaledobject.json",
}
VALUE_SETS = {"default": None, "gpu-rdma": GPU_VALUES}
BAD_VALUES = Path(__file__).resolve().parent / "values-bad.yaml"


def _values(which: str) -> dict[str, Any]:
    path = VALUE_SETS[which]
    return values_file(path) if path else {}


def _crd_validator(kind: str) -> Any:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text())
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("which", VALUE_SETS)
def test_lint_is_clean_in_strict_mode(which: str) -> None:
    report = helm.lint(str(CHART), _values(which), strict=True, kube_version=f"v{KUBE_VERSION}")
    serious = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert not report["errors"] and not serious, report


@pytest.mark.parametrize("which", VALUE_SETS)
def test_every_object_validates(which: str) -> None:
    objs = objects(_values(which))
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceAccount"} <= kinds
    for obj in objs:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CRD_SCHEMAS:
            errors = sorted(e.message for e in _crd_validator(obj["kind"]).iter_errors(obj))
            assert not errors, f"{where}: {errors}"
        else:
            try:
                kv.validate(obj, KUBE_VERSION, strict=True)
            except kv.ValidationError as e:  # pragma: no cover - the message is the point
                pytest.fail(f"{where}: {e}")
    if which == "gpu-rdma":  # the values file that turns every optional object on
        assert set(CRD_SCHEMAS) | {"StatefulSet"} <= kinds


def test_crd_schemas_are_not_vacuous() -> None:
    """The vendored schemas catch what the API server would refuse (or silently drop)."""
    so = by_kind(objects(values_file(GPU_VALUES)), "ScaledObject")[0]
    bad = json.loads(json.dumps(so))
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 8  # trigger metadata must be strings
    del bad["spec"]["scaleTargetRef"]["name"]
    messages = " ".join(e.message for e in _crd_validator("ScaledObject").iter_errors(bad))
    assert "'name' is a required property" in messages and "is not of type 'string'" in messages
    sm = by_kind(objects(values_file(GPU_VALUES)), "ServiceMonitor")[0]
    bad = json.loads(json.dumps(sm))
    bad["spec"]["endpoint"] = bad["spec"].pop("endpoints")  # a typo the server would prune
    assert list(_crd_validator("ServiceMonitor").iter_errors(bad))


def test_values_schema_rejects_a_bad_values_file() -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        render(values_file(BAD_VALUES))
    msg = str(e.value)
    for problem in [
        "'/router/port': got string, want integer",
        "'/prefill': additional properties 'replica' not allowed",
        "'/decode/kind'",  # Deployment or StatefulSet only
        "'/model/source/type'",
        "'/node/memFractionStatic'",
        "'/logging': additional properties 'formt' not allowed",
    ]:
        assert problem in msg, (problem, msg)


def test_schema_takes_every_key_of_the_shipped_values() -> None:
    """values.yaml and the GPU example are valid against the schema, key for key."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    defaults = values_file(CHART / "values.yaml")
    for name, values in [
        ("values.yaml", defaults),
        ("values-gpu-rdma.yaml", _merged(defaults, values_file(GPU_VALUES))),
    ]:
        assert not [e.message for e in validator.iter_errors(values)], name
    merged = values_file(CHART / "values.yaml")
    merged["router"]["apiKeys"]["keyz"] = []  # the chart's schema is strict below the top level too
    assert any("keyz" in e.message for e in validator.iter_errors(merged))


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of a values file over the defaults (maps merge, the rest replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("which", VALUE_SETS)
def test_pods_run_unprivileged(which: str) -> None:
    objs = objects(_values(which))
    rdma = which == "gpu-rdma"
    for workload in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        for c in containers(workload):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            is_node = c["name"] in ("prefill", "decode")
            # IPC_LOCK only where UCX registers memory for RDMA, nothing else ever comes back
            assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if rdma and is_node else [])
            # a read-only root needs a writable /tmp (caches) and, on nodes, a real /dev/shm
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts and (not is_node or mounts.get("/dev/shm") == "shm")
            assert c["resources"].get("limits", {}).get("memory"), c["name"]
