"""bench/stream_overhead.py runs both hand-overs through the node's stream path and reports each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.stream_overhead import HANDOVERS, main, measure


def test_each_hand_over_delivers_every_token_and_restores_the_switch_interval() -> None:
    before = sys.getswitchinterval()
    for handover in HANDOVERS:
        row = measure(streams=4, steps=6, step_s=0.001, message_s=0.0, handover=handover, switch_s=0.002)
        # each stream gets its 6 tokens, in at most 6 messages, and its end
        assert 2 <= row["messages_per_stream"] <= 7
        assert row["step_wall_ms"] >= row["device_step_ms"]
    assert sys.getswitchinterval() == before


def test_quick_run_writes_every_setting(tmp_path: Path) -> None:
    out = tmp_path / "stream.json"
    assert main(["--quick", "--out", str(out), "--step-ms", "1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["handover"], r["switch_interval_ms"]) for r in rows} == {(h, s) for h in HANDOVERS for s in (5.0, 1.0)}
