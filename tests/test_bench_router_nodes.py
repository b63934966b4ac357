"""bench.router_nodes' fake nodes: they report measured rates as real nodes do, and pace their streams."""

from __future__ import annotations

import asyncio
import time

import pytest
from google.protobuf import json_format
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from bench.router_nodes import InstantNode
from router.perf import NodePerf


def test_fake_nodes_report_measured_rates_so_the_router_does_not_reread_them_per_request() -> None:
    node = InstantNode("decode", "/tok", [5, 6, 7], per_chunk=2)
    info = asyncio.run(node.GetServerInfo(pb.GetServerInfoRequest(), None))  # type: ignore[arg-type]
    args = json_format.MessageToDict(info.server_args)
    perf = NodePerf.parse(args["perf"])
    assert args["disaggregation_mode"] == "decode"
    assert perf.prefill_tokens_per_s > 0 and perf.decode_step_s  # router/dispatch.py's _learn_* skip them


def test_decode_streams_its_messages_paced_by_the_interval() -> None:
    node = InstantNode("decode", "/tok", [5, 6, 7], per_chunk=2, token_interval_s=0.01)
    req = pb.GenerateRequest(request_id="r", sampling_params=pb.SamplingParams(max_new_tokens=6))

    async def collect() -> tuple[list[pb.GenerateResponse], float]:
        start = time.perf_counter()
        out = [r async for r in node.Generate(req, None)]  # type: ignore[arg-type]
        return out, time.perf_counter() - start

    out, took = asyncio.run(collect())
    chunks = [list(r.chunk.token_ids) for r in out if r.HasField("chunk")]
    assert chunks == [[5, 6], [7, 5], [6, 7]] and out[-1].HasField("complete")
    assert took >= 2 * 2 * 0.01  # a pause between messages (a token's time each), none before the first
    asked = pb.GenerateRequest(request_id="r", sampling_params=pb.SamplingParams(max_new_tokens=6, stream_interval=4))
    out = asyncio.run(collect_from(node, asked))
    assert [list(r.chunk.token_ids) for r in out if r.HasField("chunk")] == [[5, 6, 7, 5], [6, 7]]


async def collect_from(node: InstantNode, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [r async for r in node.Generate(req, None)]  # type: ignore[arg-type]


@pytest.mark.slow  # a real router process and node processes, three times
def test_router_paced_quick_splits_the_router_cpu_and_the_router_paces_its_streams() -> None:
    from bench.router_paced import format_table, run

    report = run(quick=True, budget=500.0)
    levels = report["levels"]
    assert [(lv["tokens_per_message"], lv["router_budget_messages_per_s"]) for lv in levels] == [
        (1, 0.0),
        (32, 0.0),
        (1, 500.0),
    ]
    for lv in levels:
        assert lv["completed"] == lv["requests"] > 0 and lv["router_cpu_ms_per_request"] > 0
    assert levels[0]["messages_per_request"] == report["output_tokens"] and levels[2]["messages_per_request"] is None
    # 256 messages a request cost the router more than 8 do
    assert levels[0]["router_cpu_ms_per_request"] > levels[1]["router_cpu_ms_per_request"]
    assert report["fit"]["per_message_ms"] > 0
    # 10 req/s of 256 tokens against 500 messages a second: the router asked nodes for several a message
    assert levels[0]["router_interval_tokens"] is None and max(levels[2]["router_interval_asked"]) > 1
    assert format_table(report).startswith("| tokens a message")
