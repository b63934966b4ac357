"""The chart's tensor-parallel settings: a group's tpSize sets --tp-size, one GPU per rank and a
/dev/shm per rank; the colocated group (off by default) is how TP pods serve for now, addressed by
the router pod by pod; prefill and decode groups refuse tpSize > 1 at render time."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chartkit import (
    GPU_VALUES,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    by_kind,
    cli_params,
    containers,
    flag,
    helm,
    named,
    objects,
    render,
    values_file,
)

BASE = f"{RELEASE}-pdserve"
COLOCATED = {"colocated": {"replicas": 2, "tpSize": 2}}


def _gpu(**over: Any) -> dict[str, Any]:
    values = values_file(GPU_VALUES)
    for key, value in over.items():
        values[key] = {**values.get(key, {}), **value}
    return values


def _pod(objs: list[dict[str, Any]], kind: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    workload = named(objs, kind, name)
    return workload["spec"]["template"]["spec"], next(containers(workload))


def test_colocated_group_is_off_by_default() -> None:
    objs = objects({})
    assert not [o for o in objs if o["metadata"]["name"].startswith(f"{BASE}-colocated")]
    _, router = _pod(objs, "Deployment", f"{BASE}-router")
    assert flag(router["args"], "--colocated") == []


def test_a_tp2_colocated_group_gets_two_gpus_shm_and_the_router() -> None:
    gpu = values_file(GPU_VALUES)
    colocated = {**COLOCATED["colocated"], "resources": {"limits": {"memory": "64Gi", "nvidia.com/gpu": 1}}}
    objs = objects(_gpu(colocated=colocated))
    pod, c = _pod(objs, "StatefulSet", f"{BASE}-colocated")
    assert c["args"][0] == "serve" and flag(c["args"], "--tp-size") == ["2"]
    params = cli_params(c["args"])  # the real CLI takes what the chart gives
    assert params["tp_size"] == 2 and params["device"] == "auto"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2  # one per rank, whatever the group said
    shm = {v["name"]: v for v in pod["volumes"]}["shm"]["emptyDir"]
    per_rank = int(gpu["node"]["shmSizeLimit"].removesuffix("Gi"))
    assert shm == {"medium": "Memory", "sizeLimit": f"{2 * per_rank}Gi"}
    assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/dev/shm"] == "shm"
    _, router = _pod(objs, "Deployment", f"{BASE}-router")
    fqdn = f"{BASE}-colocated.{NAMESPACE}.svc.cluster.local"
    assert flag(router["args"], "--colocated") == [f"{BASE}-colocated-{i}.{fqdn}:30000" for i in range(2)]
    assert cli_params(router["args"])["colocated"] == flag(router["args"], "--colocated")
    for group in ("prefill", "decode"):  # one rank each
        workload = next(w for w in objs if w["metadata"]["name"] == f"{BASE}-{group}" and "template" in w["spec"])
        node = next(containers(workload))
        assert flag(node["args"], "--tp-size") == ["1"] and node["resources"]["limits"]["nvidia.com/gpu"] == 1
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for obj in objs:
        if obj["metadata"]["name"].startswith(f"{BASE}-colocated"):
            kv.validate(obj, KUBE_VERSION, strict=True)
    pdb = named(objs, "PodDisruptionBudget", f"{BASE}-colocated")
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "colocated"
    [monitor] = by_kind(objs, "PodMonitor")
    assert "colocated" in monitor["spec"]["selector"]["matchExpressions"][0]["values"]


def test_gpus_follow_the_device() -> None:
    """Ranks on the CPU (gloo) ask for no GPU; on any other device each rank needs one."""
    cpu = objects({**COLOCATED, "node": {"device": "cpu"}})
    _, c = _pod(cpu, "StatefulSet", f"{BASE}-colocated")
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and flag(c["args"], "--tp-size") == ["2"]
    _, c = _pod(objects(COLOCATED), "StatefulSet", f"{BASE}-colocated")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    _, c = _pod(objects({"colocated": {"replicas": 1}}), "StatefulSet", f"{BASE}-colocated")
    assert "nvidia.com/gpu" not in c["resources"]["limits"]  # the CPU demo stays GPU-free


def test_prefill_and_decode_groups_take_their_own_tp_sizes() -> None:
    docs = objects({"prefill": {"tpSize": 2}, "decode": {"tpSize": 1}})
    _, p = _pod(docs, "Deployment", f"{BASE}-prefill")
    _, d = _pod(docs, "Deployment", f"{BASE}-decode")
    assert flag(p["args"], "--tp-size") == ["2"] and flag(d["args"], "--tp-size") == ["1"]


@pytest.mark.parametrize(
    "values, where",
    [
        ({"colocated": {"replicas": 1, "tpSize": 0}}, "/colocated/tpSize"),
        ({"node": {"shmSizeLimit": "1.5Gi"}}, "/node/shmSizeLimit"),
    ],
)
def test_schema_refuses_bad_tp_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=where):
        render(values)


def test_colocated_must_be_a_statefulset() -> None:
    with pytest.raises(Exception, match="colocated.kind must be StatefulSet"):
        render({"colocated": {"replicas": 1, "kind": "Deployment"}})


def test_lint_is_clean_with_a_tp_colocated_group() -> None:
    report = helm.lint(str(GPU_VALUES.parent), _gpu(**COLOCATED), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
