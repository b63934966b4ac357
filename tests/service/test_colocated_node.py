"""`pdserve serve` as a real process behind the SGLang scheduler gRPC API."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.procs import Node

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def node(tiny_llama_dir):
    n = Node(["serve", "--model", str(tiny_llama_dir), "--port", "0", "--page-size", "4"]).wait_ready()
    yield n
    n.kill()


@pytest.fixture(scope="module")
def stub(node):
    channel = grpc.insecure_channel(f"127.0.0.1:{node.ports['scheduler']}")
    yield pb_grpc.SglangSchedulerStub(channel)
    channel.close()


def _request(rid, stream=False, **sp):
    params = pb.SamplingParams(**{"temperature": 0.0, "max_new_tokens": 12, **sp})
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=params, stream=stream
    )


def test_model_info_and_health(stub, tiny_llama_dir):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.served_model_name and info.vocab_size > 0 and info.max_context_length > 0
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args["disaggregation_mode"] == "null"
    assert stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0].max_total_num_tokens > 0


def test_generate_matches_the_in_process_engine(stub, tiny_llama_dir):
    want = (
        Engine(EngineConfig(str(tiny_llama_dir), page_size=4))
        .generate([PROMPT], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
        .output_ids
    )
    [resp] = list(stub.Generate(_request("a"), timeout=30))
    assert list(resp.complete.output_ids) == want
    assert resp.complete.finish_reason == "length" and resp.complete.completion_tokens == 12
    streamed = list(stub.Generate(_request("b", stream=True), timeout=30))
    chunks = [t for r in streamed if r.HasField("chunk") for t in r.chunk.token_ids]
    assert chunks == want and streamed[-1].HasField("complete")


def test_min_new_tokens_travels_and_holds_back_stop_tokens(stub, tiny_llama_dir):
    eng = Engine(EngineConfig(str(tiny_llama_dir), page_size=4))
    free = eng.generate([PROMPT], SamplingParams(max_new_tokens=12, temperature=0.0))[0].output_ids
    stop = free[1]  # without min_new_tokens the request would end at its 2nd token
    want = eng.generate(
        [PROMPT], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,), min_new_tokens=6)
    )[0].output_ids
    [resp] = list(stub.Generate(_request("min", stop_token_ids=[stop], min_new_tokens=6), timeout=30))
    assert list(resp.complete.output_ids) == want and len(want) >= 6 and stop not in want[:6]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request("min-too-big", min_new_tokens=13), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_new_tokens" in e.value.details()


def test_logit_bias_travels(stub):
    [resp] = list(stub.Generate(_request("bias", logit_bias={"42": 100.0}), timeout=30))
    assert list(resp.complete.output_ids) == [42] * 12
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request("bias-bad", logit_bias={"x": 1.0}), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in e.value.details()


def test_bad_requests_get_a_status_and_the_node_keeps_serving(stub):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request("bad", n=2), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request("bad2", temperature=-1.0), timeout=10))
    assert "temperature" in e.value.details()
    assert stub.Abort(pb.AbortRequest(request_id="nobody"), timeout=10).success
    [resp] = list(stub.Generate(_request("after"), timeout=30))
    assert len(resp.complete.output_ids) == 12


def test_cancelled_stream_frees_its_pages(stub):
    call = stub.Generate(_request("cancel-me", stream=True, **{}), timeout=30)
    next(iter(call))
    call.cancel()
    loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    for _ in range(100):
        if loads.loads[0].num_used_tokens == 0:
            break
        loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.loads[0].num_used_tokens == 0 and loads.loads[0].num_running_reqs == 0


def test_sigterm_stops_cleanly(tiny_llama_dir):
    n = Node(["serve", "--model", str(tiny_llama_dir), "--port", "0"]).wait_ready()
    assert n.stop() == 0
    assert not [line for line in n.lines if "leaked" in line], "\n".join(n.lines[-40:])  # nanobind's exit report


def test_sglang_flag_names_and_env_vars_configure_a_node(tiny_llama_dir):
    """--served-model-name sets GetModelInfo.served_model_name; PDSERVE_<FLAG> sets a flag."""
    n = Node(
        ["serve", "--model-path", str(tiny_llama_dir), "--port", "0", "--served-model-name", "tiny-served"],
        env={"PDSERVE_MAX_RUNNING": "7", "PDSERVE_PAGE_SIZE": "4"},
    ).wait_ready()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{n.ports['scheduler']}") as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).served_model_name == "tiny-served"
            args = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args
            assert (args["max_running_requests"], args["page_size"]) == (7, 4)
    finally:
        n.kill()
