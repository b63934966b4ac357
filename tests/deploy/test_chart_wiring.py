"""The rendered chart is wired together: the router discovers the headless services on their real
ports, probes and monitors hit ports that exist, API keys come only from a Secret, autoscalers
and PDBs select what they should, and nodes get the flags and RDMA settings of the contract."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chartkit import (
    GPU_VALUES,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    by_kind,
    containers,
    flag,
    named,
    objects,
)
from tests.deploy.chartkit import cli_params, values_file

BASE = f"{RELEASE}-pdserve"
GROUPS = ("prefill", "decode")
SECRET_KEY = "sk-do-not-leak-0123456789"


def _workloads(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """component -> its Deployment or StatefulSet."""
    return {
        w["metadata"]["labels"]["app.kubernetes.io/component"]: w
        for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet")
    }


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e  # the only operator the chart uses
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _port_numbers(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


@pytest.fixture(params=["default", "gpu-rdma"])
def objs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return objects(values_file(GPU_VALUES) if request.param == "gpu-rdma" else {})


def test_router_discovers_the_headless_services_on_their_ports(objs: list[dict[str, Any]]) -> None:
    router = next(containers(_workloads(objs)["router"]))
    for group in GROUPS:
        svc = named(objs, "Service", f"{BASE}-{group}")
        assert svc["spec"]["clusterIP"] == "None" and not svc["spec"]["publishNotReadyAddresses"]
        assert _selects({"matchLabels": svc["spec"]["selector"]}, _pod_labels(_workloads(objs)[group]))
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        node = next(containers(_workloads(objs)[group]))
        for p in ports.values():  # each service port forwards to a named port the pod has
            assert _port_numbers(node)[p["targetPort"]] == p["port"], p
        [dns] = flag(router["args"], f"--{group}-dns")
        fqdn = f"{BASE}-{group}.{NAMESPACE}.svc.cluster.local"
        expected = f"{fqdn}:{ports['grpc']['port']}"
        if group == "prefill":  # decode nodes dial the prefill's bootstrap port for the KV handshake
            expected += f",{ports['bootstrap']['port']}"
            assert flag(node["args"], "--bootstrap-port") == [str(ports["bootstrap"]["port"])]
        assert dns == expected
        assert flag(node["args"], "--port") == [str(ports["grpc"]["port"])]
        assert flag(node["args"], "--metrics-port") == [str(ports["metrics"]["port"])]


def test_probes_hit_ports_the_containers_have(objs: list[dict[str, Any]]) -> None:
    for component, workload in _workloads(objs).items():
        for c in containers(workload):
            ports = _port_numbers(c)
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(kind)
                if probe is None:
                    assert component == "router" and kind == "startupProbe"
                    continue
                action = probe.get("grpc") or probe.get("httpGet")
                port = action["port"]
                assert port in ports or port in ports.values(), (component, kind, port)
                if component == "router":
                    assert probe["httpGet"]["path"] == ("/health" if kind == "livenessProbe" else "/ready")
                else:  # standard gRPC health on the scheduler port, service ""
                    assert port == ports["grpc"] and "service" not in probe["grpc"]
            assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        spec = workload["spec"]["template"]["spec"]
        sleep = int(next(containers(workload))["lifecycle"]["preStop"]["exec"]["command"][1])
        assert spec["terminationGracePeriodSeconds"] > sleep  # time left to drain after preStop


def test_startup_probe_budgets_the_model_load(objs: list[dict[str, Any]]) -> None:
    for group in GROUPS:
        probe = next(containers(_workloads(objs)[group]))["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 600  # 10 minutes at least


def test_monitors_scrape_ports_that_exist() -> None:
    objs = objects(values_file(GPU_VALUES))
    work = _workloads(objs)
    sm = by_kind(objs, "ServiceMonitor")[0]
    router_svc = named(objs, "Service", f"{BASE}-router")
    assert _selects(sm["spec"]["selector"], router_svc["metadata"]["labels"])
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    svc_ports = {p["name"] for p in router_svc["spec"]["ports"]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["http"] and "http" in svc_ports
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    pm = by_kind(objs, "PodMonitor")[0]
    selected = {c for c, w in work.items() if _selects(pm["spec"]["selector"], _pod_labels(w))}
    assert selected == set(GROUPS)
    for group in GROUPS:
        for e in pm["spec"]["podMetricsEndpoints"]:
            assert e["port"] in _port_numbers(next(containers(work[group])))


def test_api_keys_come_from_a_secret_and_never_from_argv() -> None:
    gpu = values_file(GPU_VALUES)
    router = next(containers(_workloads(objects(gpu))["router"]))
    [env] = [e for e in router["env"] if e["name"] == "PDSERVE_API_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref == {"name": gpu["router"]["apiKeys"]["existingSecret"], "key": "api-keys"}
    assert not any("api-key" in a or "api_key" in a for a in router["args"])
    # A chart-made Secret: the key is in the Secret and nowhere else.
    objs = objects({"router": {"apiKeys": {"create": True, "keys": [SECRET_KEY, "second"]}}})
    secret = named(objs, "Secret", f"{BASE}-api-keys")
    import base64

    assert base64.b64decode(secret["data"]["api-keys"]).decode() == f"{SECRET_KEY},second"
    others = [o for o in objs if o is not secret]
    assert SECRET_KEY not in repr(others) and base64.b64encode(SECRET_KEY.encode()).decode() not in repr(others)
    router = next(containers(_workloads(objs)["router"]))
    assert [e["valueFrom"]["secretKeyRef"]["name"] for e in router["env"] if e["name"] == "PDSERVE_API_KEY"] == [
        f"{BASE}-api-keys"
    ]
    # No keys configured: no env at all (an open router), still nothing in argv.
    router = next(containers(_workloads(objects({}))["router"]))
    assert "PDSERVE_API_KEY" not in {e["name"] for e in router["env"]}


def test_autoscalers_and_budgets_select_their_groups() -> None:
    objs = objects(values_file(GPU_VALUES))
    work = _workloads(objs)
    [hpa] = by_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{BASE}-router"}
    assert "replicas" not in work["router"]["spec"]  # the HPA owns it
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in by_kind(objs, "ScaledObject")}
    assert set(scaled) == {work[g]["metadata"]["name"] for g in GROUPS}
    for group in GROUPS:
        so = scaled[work[group]["metadata"]["name"]]
        assert so["spec"]["scaleTargetRef"]["kind"] == work[group]["kind"]
        assert "replicas" not in work[group]["spec"]  # KEDA owns it
        [trigger] = so["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        assert trigger["type"] == "prometheus" and f'namespace="{NAMESPACE}"' in query
        assert f'pod=~"{BASE}-{group}-.*"' in query
    decode_query = scaled[f"{BASE}-decode"]["spec"]["triggers"][0]["metadata"]
    assert "pdserve_node_waiting_requests" in decode_query["query"] and 'queue="prealloc"' in decode_query["query"]
    prefill_query = scaled[f"{BASE}-prefill"]["spec"]["triggers"][0]["metadata"]
    assert 'pdserve_node_waiting_prompt_tokens{role="prefill"' in prefill_query["query"]
    assert prefill_query["threshold"] == "32768" and scaled[f"{BASE}-prefill"]["spec"]["maxReplicaCount"] == 8
    # Off by default: one ScaledObject (decode), and the prefill group keeps its replicas.
    only_decode = objects({"keda": {"enabled": True}})
    assert [so["spec"]["scaleTargetRef"]["name"] for so in by_kind(only_decode, "ScaledObject")] == [f"{BASE}-decode"]
    assert _workloads(only_decode)["prefill"]["spec"]["replicas"] == 1
    prefill_only = objects({"keda": {"prefill": {"enabled": True}}})
    assert [so["metadata"]["name"] for so in by_kind(prefill_only, "ScaledObject")] == [f"{BASE}-prefill"]
    assert work["prefill"]["spec"]["serviceName"] == f"{BASE}-prefill"  # StatefulSet in this file
    pdbs = by_kind(objs, "PodDisruptionBudget")
    for component, workload in work.items():
        matching = [p for p in pdbs if _selects(p["spec"]["selector"], _pod_labels(workload))]
        assert len(matching) == 1, component


def test_nodes_get_the_flags_model_volume_and_rdma_settings() -> None:
    gpu = values_file(GPU_VALUES)
    objs = objects(gpu)
    work = _workloads(objs)
    mount = gpu["model"]["mountPath"]
    for component, workload in work.items():
        c = next(containers(workload))
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["model"]["mountPath"] == mount and mounts["model"]["readOnly"] is True
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == gpu["model"]["source"]["pvc"]["claimName"]
        if component == "router":
            assert flag(c["args"], "--tokenizer") == [gpu["model"]["path"]]
            assert flag(c["args"], "--served-model") == [gpu["model"]["servedName"]]
            continue
        args = c["args"]
        assert args[0] == component
        assert flag(args, "--model") == [gpu["model"]["path"]] and gpu["model"]["path"].startswith(mount + "/")
        assert flag(args, "--host") == ["0.0.0.0"] and flag(args, "--device") == ["auto"]
        assert flag(args, "--served-model-name") == [gpu["model"]["servedName"]]
        assert flag(args, "--speculative-algorithm") == ["EAGLE3"] and "--speculative-adaptive" in args
        assert flag(args, "--speculative-draft-model-path") == [gpu["speculative"]["draftModelPath"]]
        for f in ("--mem-fraction-static", "--log-level", "--log-format"):
            assert len(flag(args, f)) == 1, f
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"] == gpu["rdma"]["ucxTls"] and env["UCX_NET_DEVICES"] == gpu["rdma"]["ucxNetDevices"]
        assert env["NIXL_LOG_LEVEL"] == "WARN"
        limits = c["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1 and limits["rdma/rdma_shared_device_a"] == 1
        shm = volumes["shm"]["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"] == gpu["node"]["shmSizeLimit"]


def test_every_process_takes_the_flags_the_chart_gives_it(objs: list[dict[str, Any]]) -> None:
    from common.logs import FORMATS, LEVELS

    for component, workload in _workloads(objs).items():
        c = next(containers(workload))
        params = cli_params(c["args"])
        assert params["host"] == "0.0.0.0", component
        assert params["log_level"] in LEVELS and params["log_format"] in FORMATS
        if component != "router":
            assert params["device"] == "auto" and 0 < params["mem_fraction_static"] <= 1
            assert params["max_total_tokens"] is None  # sized from the memory fraction
        else:
            assert params["pd_prefill_policy"] == "remote" and params["pd_pooling"] == "off"
            assert (params["pd_local_max_tokens"], params["pd_remote_ttft_target_ms"]) == (256, 200.0)
            assert params["pd_mixed_remote_ttft_target_ms"] == 0.0
        if component == "prefill":  # no whole requests unless the router pools
            assert params["local_decode_tpot_ms"] == 0.0


def test_pooling_gives_prefill_pods_a_guard_for_whole_requests() -> None:
    values = {"router": {"pdPrefillPolicy": "auto", "pdPooling": "auto"}, "prefill": {"localDecodeTpotMs": 20}}
    workloads = _workloads(objects(values))
    router = cli_params(next(containers(workloads["router"]))["args"])
    assert (router["pd_prefill_policy"], router["pd_pooling"]) == ("auto", "auto")
    prefill = cli_params(next(containers(workloads["prefill"]))["args"])
    assert prefill["local_decode_tpot_ms"] == 20.0
    assert "--local-decode-tpot-ms" not in " ".join(next(containers(workloads["decode"]))["args"])


def test_default_values_use_the_built_in_pair_without_rdma() -> None:
    objs = objects({})
    for component, workload in _workloads(objs).items():
        c = next(containers(workload))
        assert "model" not in {m["name"] for m in c["volumeMounts"]}
        env = {e["name"] for e in c["env"]}
        assert not env & {"UCX_TLS", "UCX_NET_DEVICES"}
        if component != "router":
            assert flag(c["args"], "--model") == ["/opt/pdserve/models/pycoder"]
    assert not [o for o in objs if o["kind"] in ("ServiceMonitor", "PodMonitor", "ScaledObject", "Secret")]


@pytest.mark.parametrize("source,key", [("hostPath", "hostPath"), ("image", "image")])
def test_other_model_sources(source: str, key: str) -> None:
    spec = {"pvc": {}, "hostPath": {"path": "/data/models"}, "image": {"reference": "registry.local/models/llama:1"}}
    objs = objects({"model": {"path": "/models/llama", "source": {"type": source, source: spec[source]}}})
    kv = pytest.importorskip("kubernetes_validate")
    for workload in _workloads(objs).values():
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert key in volumes["model"]
        kv.validate(workload, KUBE_VERSION, strict=True)


def test_the_tool_call_parser_reaches_the_router() -> None:
    """model.toolCallParser becomes the router's --tool-call-parser, which the CLI takes; unset, none."""
    for value, expected in (("hermes", ["hermes"]), ("", [])):
        router = _workloads(objects({"model": {"toolCallParser": value}}))["router"]
        args = next(containers(router))["args"]
        assert flag(args, "--tool-call-parser") == expected
        assert cli_params(args)["tool_call_parser"] == (value or None)
