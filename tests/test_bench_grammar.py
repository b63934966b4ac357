"""bench/gpu/grammar.py's code path on a tiny shape on the CPU: the report's layout, and EAGLE's
output under the JSON schema equal to plain decoding under it (CPU timings mean nothing)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu.grammar import GOALS, run


def test_grammar_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    report = run(tmp_path, tiny=True, compiles=5, repeats=1)
    saved = json.loads((tmp_path / "grammar_cpu.json").read_text())
    assert saved["goals"] == GOALS and saved["compile"]["compiles"] == 5
    assert 0 < report["compile"]["p50_ms"] <= report["compile"]["p99_ms"]
    assert report["mask_cost"]["batch"] == 4 and report["mask_cost"]["constrained_step_ms"] > 0
    assert [p["batch"] for p in report["eagle"]] == [1, 2]
    for point in report["eagle"]:
        for label in ("free", "json"):
            assert point[label]["exact"] == 1.0 and point[label]["accept_len"] > 1.5
        assert point["speedup_ratio"] > 0
