"""A prefill node that runs requests whole (`--local-decode-tpot-ms`, the router's whole path when
the decode tier is at its TPOT budget): it says so in GetServerInfo, its whole requests give the
colocated output while PD requests run through it beside them (real processes, NIXL over UCX),
one aborted before it arrives ends on arrival, one dropped mid-stream frees what it held, and
every page returns to both pools."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import json_format
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from fixtures.pdkit import Legs, local_request, pd_generate, request, start_pair, stub, wait_idle
from fixtures.procs import Node

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
CHUNK = 8
PROMPTS = [list(range(3, 60)), [7, 9, 11] * 13, list(range(200, 212))]  # 57, 39, 12 tokens


def _server_args(s) -> dict:
    return json_format.MessageToDict(s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args)


def test_a_prefill_node_runs_whole_requests_as_colocated_beside_pd_ones(tiny_llama_dir):
    extra = ["--chunked-prefill-size", str(CHUNK)]
    colo = Node(["serve", "--model", str(tiny_llama_dir), "--port", "0", "--page-size", "4", *extra])
    prefill, decode = start_pair(str(tiny_llama_dir), *extra, prefill_extra=("--local-decode-tpot-ms", "25"))
    try:
        colo.wait_ready(120)
        c, p, d = stub(colo.ports["scheduler"]), stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        args = _server_args(p)
        assert args["local_decode"] is True and args["perf"]["tpot_guard_s"] == pytest.approx(0.025)
        boot = prefill.ports["bootstrap"]
        # a long whole request decodes on the prefill node while the PD and whole ones below run
        background = Legs(local_request("bg", PROMPTS[0], max_new=120), prefill=p, timeout=120)
        for i, ids in enumerate(PROMPTS):
            want = list(c.Generate(request(f"c{i}", ids, 0, 0, max_new=16), timeout=60))[-1].complete
            whole = list(p.Generate(local_request(f"w{i}", ids, max_new=16), timeout=60))[-1].complete
            assert list(whole.output_ids) == list(want.output_ids), ("whole", i)
            got, _ = pd_generate(p, d, request(f"pd{i}", ids, 600 + i, boot, max_new=16))
            assert list(got[-1].complete.output_ids) == list(want.output_ids), ("pd", i)
        bg = background.join(120)["p"]
        want_bg = list(c.Generate(request("cbg", PROMPTS[0], 0, 0, max_new=120), timeout=60))[-1].complete
        assert not isinstance(bg, Exception) and list(bg[-1].complete.output_ids) == list(want_bg.output_ids)
        # an abort that comes before its request ends it on arrival
        p.Abort(pb.AbortRequest(request_id="early", reason="client went away"), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            list(p.Generate(local_request("early", PROMPTS[2]), timeout=30))
        assert "aborted before it arrived" in e.value.details()
        # a client that goes away mid-stream: the prefill node frees the request's pages
        dropped = Legs(local_request("gone", PROMPTS[1], max_new=400, stream=True), prefill=p, timeout=120)
        dropped.drop()
        dropped.join(60)
        wait_idle(p)
        wait_idle(d)
    finally:
        colo.kill()
        prefill.kill()
        decode.kill()
