"""--tp-size on the node commands: checked before anything loads, flags reach the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdserve.cli import app
from pdserve.tp import TpSetupError, check_gpus, gpus_per_node


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tp") / "tiny", seed=3)  # 4 heads, 2 KV heads


def _error(args: list[str]) -> str:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


@pytest.mark.parametrize("role", ["serve", "prefill", "decode"])
def test_bad_sizes_and_timeouts_are_one_line_errors(role: str) -> None:
    assert "--tp-size must be >= 1, got 0" in _error([role, "--tp-size", "0"])
    assert "--tp-timeout-s must be > 0" in _error([role, "--tp-timeout-s", "0"])


def test_a_model_that_does_not_split_fails_before_loading(model_dir: Path) -> None:
    line = _error(["serve", "--model", str(model_dir), "--device", "cpu", "--port", "0", "--tp-size", "3"])
    assert "cannot be split over --tp-size 3" in line and "attention heads 4" in line


def test_missing_gpus_are_named() -> None:
    check_gpus("cpu", 8, 0)  # every rank on the CPU
    check_gpus("cuda:1", 1, 2)
    check_gpus("cuda:0", 2, 2)
    with pytest.raises(TpSetupError, match=r"cuda:1\.\.cuda:2, but 2 CUDA device\(s\)"):
        check_gpus("cuda:1", 2, 2)
    with pytest.raises(TpSetupError, match=r"cuda:0\.\.cuda:3"):
        check_gpus("cuda", 4, 1)


def test_up_needs_a_gpu_per_rank_of_every_node() -> None:
    gpus_per_node(2, 4, 8)
    gpus_per_node(1, 3, 1)  # one rank per node: nodes may share GPUs, as before
    with pytest.raises(TpSetupError, match="needs 6 GPUs"):
        gpus_per_node(2, 3, 4)


def test_tp_flags_reach_the_engine_config(model_dir: Path) -> None:
    from common.config import EngineOptions
    from pdserve.build import engine_config
    from pdserve.models import ModelChoice

    opts = EngineOptions(device="cpu", tp_size=2, tp_timeout_s=30.0)
    cfg = engine_config(opts, ModelChoice(model_dir, None, None, None, None))
    assert (cfg.tp_size, cfg.tp_timeout_s) == (2, 30.0)
    assert engine_config(EngineOptions(device="cpu"), ModelChoice(model_dir, None, None, None, None)).tp_size == 1
