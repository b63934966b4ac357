"""PD equals colocated under grammar constraints (real processes, real NIXL over UCX): the prefill
samples the first token under the grammar, the decode replays it once into its own matcher and
goes on, with and without speculation, on the prefill path and the decode's own; a grammar that
cannot be built fails only its request; every page returns to both pools."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from engine.kv_transfer import nixl_available
from fixtures.pdkit import local_request, pd_generate, request, start_pair, stub, wait_idle
from fixtures.procs import Node
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121))]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}
FIELDS = [{"regex": "(yes|no|maybe)"}, {"json_schema": json.dumps(SCHEMA)}, {"regex": "[a-f]{2,9}"}]
SPEC = {
    "plain": [],
    "eagle": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"],
    "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-grammar")
    target = write_tiny_model(root / "t", seed=1)
    return {"eagle": write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat")}, target


def constrained(req, field: dict):
    for k, v in field.items():
        setattr(req.sampling_params, k, v)
    return req


@pytest.mark.parametrize("mode", sorted(SPEC))
def test_pd_equals_colocated_under_constraints(models, mode):
    drafts, target = models
    extra = list(SPEC[mode]) + (["--speculative-draft-model-path", str(drafts[mode])] if mode in drafts else [])
    colo = Node(["serve", "--model", str(target), "--port", "0", "--page-size", "4", *extra])
    prefill, decode = start_pair(str(target), *extra)
    try:
        colo.wait_ready(120)
        c, p, d = stub(colo.ports["scheduler"]), stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        stops = 0
        for i, (ids, field) in enumerate(zip(PROMPTS, FIELDS)):
            want = list(c.Generate(constrained(request(f"c{i}", ids, 0, 0, max_new=32), field), timeout=60))
            want_done = want[-1].complete
            stops += want_done.finish_reason == "stop"
            got, box = pd_generate(p, d, constrained(request(f"pd{i}", ids, 100 + i, boot, max_new=32), field))
            done = got[-1].complete
            assert list(done.output_ids) == list(want_done.output_ids), (mode, i)
            assert done.finish_reason == want_done.finish_reason, (mode, i)
            assert list(box["p"][-1].complete.output_ids) == [want_done.output_ids[0]]  # sampled under the grammar
            local = list(d.Generate(constrained(local_request(f"l{i}", ids, max_new=32), field), timeout=60))
            assert list(local[-1].complete.output_ids) == list(want_done.output_ids), (mode, i, "local")
        assert stops >= 2  # the grammars end the requests, on both paths alike
        with pytest.raises(grpc.RpcError) as e:  # refused on the decode (and the prefill), alone
            pd_generate(p, d, constrained(request("bad", PROMPTS[0], 900, boot), {"json_schema": '{"type": "foo"}'}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "foo" in e.value.details()
        got, _ = pd_generate(p, d, constrained(request("after", PROMPTS[0], 901, boot, max_new=32), FIELDS[0]))
        assert got[-1].complete.finish_reason == "stop"
        if mode == "plain":
            mismatched_grammars_fail_alone(p, d, boot)
        wait_idle(p)
        wait_idle(d)
    finally:
        for n in (colo, prefill, decode):
            n.kill()


def mismatched_grammars_fail_alone(p, d, boot: int) -> None:
    """The prefill's first token checked against the decode's own grammar before it is replayed:
    two sides that built different grammars fail that request with a clear error, nothing leaks."""
    box: dict[str, object] = {}

    def leg(s, req, key):
        try:
            box[key] = list(s.Generate(req, timeout=60))
        except grpc.RpcError as e:
            box[key] = e

    legs = [
        threading.Thread(target=leg, args=(d, constrained(request("mm", PROMPTS[0], 950, boot), {"regex": "x+"}), "d")),
        threading.Thread(target=leg, args=(p, constrained(request("mm", PROMPTS[0], 950, boot), {"regex": "y+"}), "p")),
    ]
    for t in legs:
        t.start()
    for t in legs:
        t.join(60)
    err = box["d"]
    assert isinstance(err, grpc.RpcError) and "outside this node's grammar" in err.details(), err
