"""Small pieces every benchmark script shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write a benchmark's JSON results (next to RESULTS.md's tables) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")  # str: paths, enums
    print(f"wrote {path}")
