"""Constrained output through a colocated node's scheduler API (a real process): the SGLang fields
regex / json_schema / ebnf_grammar / structural_tag are honoured, streamed or not; a bad grammar is
INVALID_ARGUMENT naming the problem, and the node stays healthy."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from common.tokenizer import Tokenizer
from fixtures.procs import Node

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 42, 7, 99, 3]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


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


def _request(rid: str, stream: bool = False, **sp) -> pb.GenerateRequest:
    params = pb.SamplingParams(**{"temperature": 0.0, "max_new_tokens": 40, **sp})
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=params, stream=stream
    )


def _text(tiny_llama_dir, ids) -> str:
    return Tokenizer.from_dir(tiny_llama_dir).decode(list(ids))


@pytest.mark.parametrize("stream", [False, True])
def test_each_field_is_honoured(stub, tiny_llama_dir, stream):
    cases = [
        ({"regex": "(yes|no)"}, lambda t: re.fullmatch("(yes|no)", t)),
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: json.loads(t)["pick"] in ("red", "green")),
        ({"ebnf_grammar": 'root ::= "a" ("b" | "c")'}, lambda t: t in ("ab", "ac")),
    ]
    for i, (field, ok) in enumerate(cases):
        resps = list(stub.Generate(_request(f"g{i}-{stream}", stream, **field), timeout=60))
        done = resps[-1].complete
        assert done.finish_reason == "stop", (field, done)
        assert ok(_text(tiny_llama_dir, done.output_ids)), (field, _text(tiny_llama_dir, done.output_ids))
        if stream:
            assert [t for r in resps if r.HasField("chunk") for t in r.chunk.token_ids] == list(done.output_ids)


def test_json_object_and_structural_tag(stub, tiny_llama_dir):
    [resp] = list(stub.Generate(_request("obj", json_schema='{"type": "object"}', max_new_tokens=12), timeout=60))
    text = _text(tiny_llama_dir, resp.complete.output_ids)
    assert text.startswith("{")  # may be cut by the length; what is there is an object's start
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    [resp] = list(stub.Generate(_request("tag", structural_tag=json.dumps(tag), max_new_tokens=8), timeout=60))
    assert resp.complete.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "field,names",
    [
        ({"json_schema": '{"type": "foo"}'}, "foo"),
        ({"json_schema": "{oops"}, "JSON"),
        ({"regex": "(("}, "regex"),
        ({"structural_tag": '{"structures": []}'}, "structures"),
    ],
)
def test_bad_grammar_is_invalid_argument_and_the_node_stays_healthy(stub, field, names):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request("bad", **field), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and names in e.value.details()
    assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    [resp] = list(stub.Generate(_request("after-bad", regex="(yes|no)"), timeout=60))
    assert resp.complete.finish_reason == "stop"
