"""Chunked prefill in PD: each finished chunk's pages leave while the next chunk runs, so the
final write carries at most the last chunk's pages; output and acceptance still equal colocated
(real processes, NIXL over UCX, writes posted per descriptor and as scatter-gather lists), and
every page returns to both pools."""

from __future__ import annotations

import math

import pytest

from engine.kv_transfer import nixl_available
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.pdkit import Legs, local_request, pd_generate, request, start_pair, stub, wait_idle
from tests.pd.test_pd_metrics import scrape
from fixtures.procs import Node

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
CHUNK, PAGE = 8, 4
PROMPTS = [list(range(3, 60)), [7, 9, 11] * 13, list(range(200, 232))]  # 57, 39, 32 tokens


@pytest.fixture(scope="module")
def eagle_head(tiny_llama_dir, tmp_path_factory):
    return write_tiny_eagle_head(tmp_path_factory.mktemp("chunk-head"), tiny_llama_dir, "eagle", mode="repeat")


@pytest.mark.parametrize(
    "spec", [[], ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"]], ids=["plain", "eagle"]
)
def test_chunk_writes_overlap_the_prompt_and_keep_pd_equal_to_colocated(tiny_llama_dir, eagle_head, spec):
    extra = ["--chunked-prefill-size", str(CHUNK), *spec]
    if spec:
        extra += ["--speculative-draft-model-path", str(eagle_head)]
    colo = Node(["serve", "--model", str(tiny_llama_dir), "--port", "0", "--page-size", str(PAGE), *extra])
    # EAGLE's prefill posts its writes as scatter-gather lists (plain's, a copy per descriptor)
    sgl = ("--kv-write-sgl", "on" if spec else "off")
    prefill, decode = start_pair(str(tiny_llama_dir), "--metrics-port", "0", *extra, prefill_extra=sgl)
    try:
        colo.wait_ready(120)
        c, p, d = stub(colo.ports["scheduler"]), stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        m0 = scrape(prefill.ports["metrics"])
        for i, ids in enumerate(PROMPTS):
            want = list(c.Generate(request(f"c{i}", ids, 0, 0, max_new=16), timeout=60))[-1].complete
            got, _ = pd_generate(p, d, request(f"pd{i}", ids, 500 + i, boot, max_new=16), destination_first=True)
            assert list(got[-1].complete.output_ids) == list(want.output_ids), i
            assert (got[-1].complete.spec_accepted_tokens, got[-1].complete.spec_draft_tokens) == (
                want.spec_accepted_tokens,
                want.spec_draft_tokens,
            ), i
        wait_idle(p)
        wait_idle(d)
        m1 = scrape(prefill.ports["metrics"])
        m = {k: v - m0.get(k, 0.0) for k, v in m1.items()}
        kind = lambda k: (("kind", k),)  # noqa: E731
        pages = [math.ceil(len(ids) / PAGE) for ids in PROMPTS]
        assert m[("pdserve_kv_writes_total", kind("final"))] == len(PROMPTS)
        assert m[("pdserve_kv_writes_total", kind("chunk"))] >= len(PROMPTS)
        assert m[("pdserve_kv_write_pages_total", kind("chunk"))] + m[
            ("pdserve_kv_write_pages_total", kind("final"))
        ] == sum(pages)
        # the final write holds the last chunk's pages (+1 for a page a chunk boundary splits), and
        # whatever chunks finished while an earlier chunk's write was being posted: how many is
        # timing (on a busy CPU the scheduler thread outruns the event loop by one chunk or more,
        # and settling folds them into the final write), so the bound is that chunk writes carried
        # at least a whole chunk per prompt on the average, not the final write's exact share
        chunk_pages = m[("pdserve_kv_write_pages_total", kind("chunk"))]
        assert chunk_pages >= len(PROMPTS) * (CHUNK // PAGE), (chunk_pages, sum(pages))
        assert m[("pdserve_kv_handoff_tail_seconds_count", ())] == len(PROMPTS)
        for stage in ("handover", "check", "encode", "settle", "row"):  # every tail's stages
            assert m[("pdserve_kv_handoff_stage_seconds_count", (("stage", stage),))] == len(PROMPTS), stage
        assert ("one scatter-gather list" in "\n".join(prefill.lines)) == bool(spec)
        # the decode node runs the same prompts itself, in chunks between the decode steps of a
        # PD request in flight: the same tokens and acceptance
        background = Legs(request("bg", PROMPTS[0], 600, boot, max_new=200), prefill=p, decode=d, timeout=120)
        for i, ids in enumerate(PROMPTS):
            want = list(c.Generate(request(f"c{i}", ids, 0, 0, max_new=16), timeout=60))[-1].complete
            local = list(d.Generate(local_request(f"local{i}", ids, max_new=16), timeout=60))[-1].complete
            assert list(local.output_ids) == list(want.output_ids), ("local", i)
            assert (local.spec_accepted_tokens, local.spec_draft_tokens) == (
                want.spec_accepted_tokens,
                want.spec_draft_tokens,
            ), ("local", i)
        assert background.join(120)["d"][-1].HasField("complete")
        wait_idle(p)
        wait_idle(d)
    finally:
        for n in (colo, prefill, decode):
            n.kill()
