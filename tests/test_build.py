"""pdserve/build.py: the node's engine built from its flags (device resolution, fast path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import EngineOptions, SpeculativeOptions
from pdserve import build


def test_nodes_default_to_auto() -> None:
    assert EngineOptions().device == "auto"


@pytest.mark.parametrize("gpu, want", [(True, "cuda:0"), (False, "cpu")])
def test_auto_is_the_first_gpu_when_present(monkeypatch: pytest.MonkeyPatch, gpu: bool, want: str) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert build.resolve_device("auto") == want


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:1"])
def test_explicit_devices_are_kept(name: str) -> None:
    assert build.resolve_device(name) == name


def test_fast_path_refuses_an_unresolved_device() -> None:
    with pytest.raises(ValueError, match="auto"):
        EngineOptions().fast_path()


@pytest.mark.parametrize("role, want", [("decode", 256), ("prefill", 64), ("colocated", 64)])
def test_a_decode_node_runs_a_larger_batch_unless_told(role: str, want: int) -> None:
    """A decode node's steps carry no prompts beside its guard's chunks: its batch defaults larger,
    and its CUDA graphs follow it; an explicit --max-running is kept on every role."""
    opts = EngineOptions(device="cuda:0").for_role(role)
    assert opts.max_running == want and opts.fast_path()["cuda_graph_max_bs"] == want
    assert EngineOptions(max_running=5).for_role(role).max_running == 5
    assert EngineOptions(device="cuda:0", max_running=1000).fast_path()["cuda_graph_max_bs"] == 256


def test_a_node_built_with_auto_runs_on_what_auto_resolves_to(tiny_llama_dir: Path) -> None:
    """No GPU here: auto is the CPU, and so are the fast-path choices (torch attention, no overlap,
    no graphs) and the default KV capacity."""
    import torch

    engine, _ = build.build_node(EngineOptions(model=tiny_llama_dir, page_size=4), SpeculativeOptions())
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert engine.config.device == want and engine.device == torch.device(want)
    if want == "cpu":
        cfg = engine.config
        assert (cfg.attention_backend, cfg.overlap, cfg.cuda_graph_max_bs) == ("torch", False, 0)


def test_gpu_nodes_keep_one_cpu_thread_unless_told(monkeypatch):
    import torch

    from pdserve.build import limit_cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        limit_cpu_threads("cuda:0")
        assert torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS")
        limit_cpu_threads("cpu")
        assert torch.get_num_threads() == before
        limit_cpu_threads("cuda:1")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
