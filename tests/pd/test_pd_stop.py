"""A PD pair that served (EAGLE on, KV moved over NIXL) stops cleanly on SIGTERM: exit code 0, and
nothing at exit but the node's own lines (no nanobind report of Triton objects still alive)."""

from __future__ import annotations

import pytest

from engine.kv_transfer import nixl_available
from fixtures.pdkit import pd_generate, request, start_pair, stub
from fixtures.tiny_eagle import write_tiny_eagle_head

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]


def test_a_pair_that_served_stops_quietly(tiny_llama_dir, tmp_path):
    head = write_tiny_eagle_head(tmp_path / "head", tiny_llama_dir, "eagle", mode="repeat")
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"]
    prefill, decode = start_pair(str(tiny_llama_dir), *spec, "--speculative-draft-model-path", str(head))
    try:
        p, d = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        out, _ = pd_generate(p, d, request("quiet", [5, 17, 42, 7, 99, 3, 11, 250], 1, prefill.ports["bootstrap"]))
        assert len(out[-1].complete.output_ids) == 16
        for node in (decode, prefill):
            assert node.stop() == 0, "\n".join(node.lines[-40:])
            assert any("shutting down" in line for line in node.lines)
            leaks = [line for line in node.lines if "leaked" in line]
            assert not leaks, "\n".join(node.lines[-40:])
    finally:
        prefill.kill()
        decode.kill()
