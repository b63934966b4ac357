"""The tensor-parallel benchmark's code path on the CPU: a tiny model at TP 1 and TP 2 over gloo,
and the report in the layout bench/RESULTS.md records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.procs import REPO

pytestmark = pytest.mark.slow


def test_tiny_run_writes_the_report(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "bench.gpu.tp", "--tiny", "--out", str(tmp_path)], cwd=REPO, check=True, timeout=600
    )
    report = json.loads((tmp_path / "tp_cpu.json").read_text())
    assert set(report["runs"]) == {"1", "2"}
    assert set(report["ratios"]) == {
        "decode_bs1_ratio",
        "prefill_4k_ratio",
        "decode_bs64_speedup",
        "eagle_speedup_tp1",
        "eagle_speedup_tp2",
        "eagle_speedup_kept",
    }
    assert all(v > 0 for v in report["ratios"].values())
    assert all(report["runs"][tp]["eagle_bs1"]["accept_length"] >= 1 for tp in ("1", "2"))
