"""The prefix cache across the handoff (real processes, NIXL over UCX): a follow-up turn's prompt
is computed on the prefill node only past what that node caches, the decode node receives only
the pages its own cache lacks (it names how many it holds in the destination), a turn the decode
node runs itself computes only its new message, and output and acceptance equal colocated's;
both pools end free."""

from __future__ import annotations

import math

import pytest

from engine.kv_transfer import nixl_available
from fixtures.pdkit import local_request, pd_generate, request, start_pair, stub, wait_idle
from fixtures.procs import Node
from fixtures.tiny_eagle import write_tiny_eagle_head
from tests.pd.test_pd_metrics import scrape

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]
PAGE = 4
FIRST = list(range(20, 57))  # 37 tokens


@pytest.fixture(scope="module")
def eagle_head(tiny_llama_dir, tmp_path_factory):
    return write_tiny_eagle_head(tmp_path_factory.mktemp("prefix-head"), tiny_llama_dir, "eagle", mode="repeat")


def _delta(after: dict, before: dict, name: str, labels: tuple = ()) -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


@pytest.mark.parametrize("spec", ["plain", "eagle"])
def test_follow_up_turns_move_only_the_pages_the_decode_lacks(tiny_llama_dir, eagle_head, spec):
    extra = ["--page-size", str(PAGE), "--chunked-prefill-size", "16"]
    if spec == "eagle":
        extra += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"]
        extra += ["--speculative-draft-model-path", str(eagle_head)]
    colo = Node(["serve", "--model", str(tiny_llama_dir), "--port", "0", *extra])
    prefill, decode = start_pair(str(tiny_llama_dir), "--metrics-port", "0", *extra)
    try:
        colo.wait_ready(120)
        c, p, d = stub(colo.ports["scheduler"]), stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        history: list[int] = []
        for turn in range(3):
            history = history + (FIRST if turn == 0 else [3, 1, 4, 1, 5])
            want = list(c.Generate(request(f"c{turn}", history, 0, 0, max_new=12), timeout=60))[-1].complete
            mp, md = scrape(prefill.ports["metrics"]), scrape(decode.ports["metrics"])
            got, box = pd_generate(p, d, request(f"pd{turn}", history, 300 + turn, boot, max_new=12))
            done, first = got[-1].complete, box["p"][-1].complete
            assert list(done.output_ids) == list(want.output_ids), turn
            assert (done.spec_accepted_tokens, done.spec_draft_tokens) == (
                want.spec_accepted_tokens,
                want.spec_draft_tokens,
            ), turn
            mp2, md2 = scrape(prefill.ports["metrics"]), scrape(decode.ports["metrics"])
            skipped = _delta(md2, md, "pdserve_kv_transfer_skipped_pages_total")
            written = sum(_delta(mp2, mp, "pdserve_kv_write_pages_total", (("kind", k),)) for k in ("chunk", "final"))
            assert written + skipped == math.ceil(len(history) / PAGE), turn
            if turn == 0:
                assert skipped == 0 and first.cached_tokens == 0
            else:
                # the decode holds the whole last turn (prompt and reply); the prefill its prompt
                assert skipped >= (len(history) - 5 - 1) // PAGE - 1, (turn, skipped)
                assert first.cached_tokens > 0 and written < math.ceil(len(history) / PAGE) / 2
            history = history + list(done.output_ids)
        # the next turn on the decode node alone: it holds every earlier turn (prompts and replies,
        # target and draft KV) and computes only the new message
        history = history + [9, 2, 6, 5]
        want = list(c.Generate(request("c-local", history, 0, 0, max_new=12), timeout=60))[-1].complete
        local = list(d.Generate(local_request("local", history, max_new=12), timeout=60))[-1].complete
        assert list(local.output_ids) == list(want.output_ids)
        assert (local.spec_accepted_tokens, local.spec_draft_tokens) == (
            want.spec_accepted_tokens,
            want.spec_draft_tokens,
        )
        assert local.cached_tokens >= (len(history) - 4 - 1) // PAGE * PAGE - PAGE
        wait_idle(p)
        wait_idle(d)
    finally:
        for n in (colo, prefill, decode):
            n.kill()
