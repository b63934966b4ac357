"""A decode node that runs prompts itself (the router's local path): it reports what the router
decides from (measured rates, its TPOT guard, queued prompt tokens) in GetServerInfo, GetLoads
and /metrics, and a node started with the guard at 0 refuses such prompts by name."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import json_format
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from fixtures.pdkit import load, local_request, pd_generate, request, start_pair, stub, wait_idle
from tests.pd.test_pd_metrics import scrape

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
IDS = list(range(3, 40))


def _server_args(s) -> dict:
    return json_format.MessageToDict(s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args)


def test_nodes_report_their_measured_rates_and_the_decode_its_guard(tiny_llama_dir):
    """Warmed up at start (--warmup), both nodes report a prompt rate and a prompt batch's fixed
    cost before their first request; then real requests, remote and local, as without it."""
    prefill, decode = start_pair(str(tiny_llama_dir), "--metrics-port", "0", "--chunked-prefill-size", "16", "--warmup")
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        for args in (_server_args(p), _server_args(d)):
            assert args["perf"]["prefill_tokens_per_s"] > 0 and args["perf"]["prompt_overhead_s"] >= 0
        boot = prefill.ports["bootstrap"]
        pd_generate(p, d, request("pd", IDS, 7, boot, max_new=24))
        list(d.Generate(local_request("local", IDS, max_new=24), timeout=60))
        args_p, args_d = _server_args(p), _server_args(d)
        assert args_p["local_decode"] is False and args_d["local_prefill"] is True
        assert args_d["perf"]["tpot_guard_s"] == pytest.approx(0.025) and args_p["perf"]["tpot_guard_s"] is None
        assert args_p["perf"]["prefill_tokens_per_s"] > 0 and args_d["perf"]["prefill_tokens_per_s"] > 0
        perf = args_d["perf"]
        assert perf["decode_tokens_per_step"] == pytest.approx(1.0)
        assert perf["decode_step_s"] and all(float(v) > 0 for v in perf["decode_step_s"].values())
        assert perf["decode_capacity_tokens_per_s"] > 0
        assert load(d).gen_throughput > 0 and load(d).num_waiting_uncached_tokens == 0
        # what routers add to a remote prompt: the prefill's handoff tail, not the decode's wait
        assert load(p).disaggregation.kv_transfer_latency_ms > 0 and load(d).disaggregation.kv_transfer_latency_ms == 0
        m = scrape(decode.ports["metrics"])
        role = (("role", "decode"),)
        assert m[("pdserve_node_prefill_capacity_tokens_per_second", role)] > 0
        assert m[("pdserve_node_decode_capacity_tokens_per_second", role)] > 0
        assert m[("pdserve_node_decode_tokens_per_second", role)] > 0
        assert m[("pdserve_node_waiting_prompt_tokens", role)] == 0
        assert any(name == "pdserve_node_decode_step_seconds" for name, _ in m)
        wait_idle(p)
        wait_idle(d)
    finally:
        prefill.kill()
        decode.kill()


def test_a_decode_node_with_the_guard_off_refuses_prompts_without_a_prefill(tiny_llama_dir):
    """It runs no prompts, so it warms none up either (its prefill does); a prefill node refuses
    requests without a decode node unless told to decode them (--local-decode-tpot-ms)."""
    prefill, decode = start_pair(str(tiny_llama_dir), "--warmup", decode_extra=("--local-prefill-tpot-ms", "0"))
    try:
        d = stub(decode.ports["scheduler"])
        assert _server_args(d)["perf"]["prefill_tokens_per_s"] == 0
        assert _server_args(stub(prefill.ports["scheduler"]))["perf"]["prefill_tokens_per_s"] > 0
        with pytest.raises(grpc.RpcError) as e:
            list(d.Generate(local_request("local", IDS), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # a router tries another node
        assert "--local-prefill-tpot-ms 0" in e.value.details()
        assert _server_args(d)["local_prefill"] is False
        # nor does a prefill node by default decode a request sent to it alone (the whole path)
        p = stub(prefill.ports["scheduler"])
        with pytest.raises(grpc.RpcError) as e:
            list(p.Generate(local_request("whole", IDS), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "--local-decode-tpot-ms 0" in e.value.details()
        assert _server_args(p)["local_decode"] is False
        wait_idle(p)
        wait_idle(d)
    finally:
        prefill.kill()
        decode.kill()
