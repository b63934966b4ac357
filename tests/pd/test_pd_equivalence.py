"""PD output equals colocated output (real processes, real NIXL over UCX), with and without
speculation (built-ins, the bundled n-gram plugin and the out-of-tree STANDALONE plugin), on
both paths: the prefill node's, and the decode node running the prompt itself; acceptance equals
colocated's; every page returns to both pools."""

from __future__ import annotations

import pytest

import importlib.util

from engine.kv_transfer import nixl_available
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from fixtures.pdkit import local_request, pd_generate, request, start_pair, stub, wait_idle
from fixtures.procs import Node

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121)), [8, 1]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-models")
    target = write_tiny_model(root / "t", seed=1)
    return {
        "eagle": write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat"),
        "standalone": write_tiny_model(root / "d", seed=1),
    }, target


SPEC = {
    "plain": [],
    "eagle": ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"],
    "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"],
    "standalone": ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3"],
}


@pytest.mark.parametrize("mode", sorted(SPEC))
def test_pd_equals_colocated(models, mode):
    if mode == "standalone" and importlib.util.find_spec("pdserve_standalone") is None:
        pytest.skip("pip install ./examples/standalone (make test does)")
    drafts, target = models
    extra = list(SPEC[mode]) + (["--speculative-draft-model-path", str(drafts[mode])] if mode in drafts else [])
    colo = Node(["serve", "--model", str(target), "--port", "0", "--page-size", "4", *extra])
    prefill, decode = start_pair(str(target), *extra)
    try:
        colo.wait_ready(120)
        c, p, d = stub(colo.ports["scheduler"]), stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        for i, ids in enumerate(PROMPTS):
            want = list(c.Generate(request(f"c{i}", ids, 0, 0, max_new=24), timeout=60))[-1].complete
            got, box = pd_generate(p, d, request(f"pd{i}", ids, 100 + i, boot, max_new=24))
            done = got[-1].complete
            assert list(done.output_ids) == list(want.output_ids), (mode, i)
            # acceptance: the same drafts accepted in PD as colocated (zero without speculation)
            assert (done.spec_accepted_tokens, done.spec_draft_tokens) == (
                want.spec_accepted_tokens,
                want.spec_draft_tokens,
            ), (mode, i)
            assert list(box["p"][-1].complete.output_ids) == [want.output_ids[0]]
            local = list(d.Generate(local_request(f"local{i}", ids, max_new=24), timeout=60))[-1].complete
            assert list(local.output_ids) == list(want.output_ids), (mode, i, "local")
            assert (local.spec_accepted_tokens, local.spec_draft_tokens) == (
                want.spec_accepted_tokens,
                want.spec_draft_tokens,
            ), (mode, i, "local")
        streamed, _ = pd_generate(p, d, request("s", PROMPTS[0], 999, boot, max_new=24, stream=True))
        tokens = [t for r in streamed if r.HasField("chunk") for t in r.chunk.token_ids]
        assert tokens == list(streamed[-1].complete.output_ids)
        wait_idle(p)
        wait_idle(d)
    finally:
        for n in (colo, prefill, decode):
            n.kill()
