"""The conformance kit (spec.testing) passes for every built-in algorithm and the bundled n-gram
plugin, and catches a broken plugin, naming the failed check."""

from __future__ import annotations

import pytest

import spec.registry as registry
from fixtures.tiny_eagle import write_tiny_eagle_head
from spec.config import SpecConfig
from spec.ngram import NgramAlgo
from spec.registry import register_class
from spec.testing import ConformanceError, check_algorithm


@pytest.mark.parametrize("algo,topk,ntok", [("NONE", 1, None), ("EAGLE", 1, None), ("EAGLE", 2, 5), ("NGRAM", 1, None)])
def test_builtins_pass_the_kit(pair, algo: str, topk: int, ntok: int | None) -> None:
    target, head = pair
    spec = SpecConfig(algo) if algo in ("NONE", "NGRAM") else SpecConfig(algo, str(head), 3, topk, ntok)
    report = check_algorithm(spec, target)
    assert report.algorithm == algo
    assert report.checks == [
        "colocated, overlap off",
        "colocated, overlap on",
        "CUDA graphs (padded eager)",
        "PD over the in-process transport",
        "empty batch and missing handoff state",
        "generation up to the context limit",
    ]
    if algo == "EAGLE":
        assert report.mean_accept_len > 1.0  # drafts were accepted: the kit ran real drafts


def test_eagle3_passes_the_kit(pair, tmp_path) -> None:
    target, _ = pair
    head3 = write_tiny_eagle_head(tmp_path / "h3", target, "eagle3", draft_vocab_size=300)
    assert check_algorithm(SpecConfig("EAGLE3", str(head3), 3, 1), target).checks[-1].endswith("context limit")


class _BrokenAlgo(NgramAlgo):
    """Corrupts the bonus token of every speculative step: wrong, and the kit must say where."""

    def create_worker(self, parts, config):
        worker = super().create_worker(parts, config)
        real = worker._decode

        def decode(batch):
            out = real(batch)
            out.tokens = [t[:-1] + [(t[-1] + 1) % 300] for t in out.tokens]  # corrupt the bonus token
            return out

        worker._decode = decode
        return worker


def test_the_kit_names_what_a_broken_plugin_gets_wrong(pair) -> None:
    register_class("TEST_BROKEN", _BrokenAlgo)
    try:
        with pytest.raises(ConformanceError, match="colocated, overlap off: greedy output differs"):
            check_algorithm(SpecConfig("TEST_BROKEN"), pair[0])
    finally:
        registry.unregister("TEST_BROKEN")
