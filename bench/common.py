"""Small pieces every benchmark script shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def short_name(device: str) -> str:
    """A device name as results files name it: "NVIDIA H100 80GB HBM3" -> "h100"; "cpu" stays."""
    parts = device.split()
    return parts[1].lower() if len(parts) > 1 and parts[0] == "NVIDIA" else parts[0].lower()


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write a benchmark's JSON results (next to RESULTS.md's tables) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")  # str: paths, enums
    print(f"wrote {path}")
