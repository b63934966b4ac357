"""The GPU's idle gaps in a torch profiler Chrome trace, and what the host ran during them.

`gaps_of_trace(trace)` takes a trace recorded with CPU and CUDA activities (and Python stacks):
the gaps between GPU work longer than `min_us` inside the span of GPU work, then for all gaps
together the time each Python function, torch op and CUDA runtime call overlapped them.
Python functions nest, so a caller's overlap includes its callees'. Also
`python -m bench.gpu.trace_gaps TRACE.json[.gz]` to read a saved trace.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")


def _intervals(events: list[dict[str, Any]], cats: tuple[str, ...]) -> list[tuple[float, float, dict[str, Any]]]:
    return sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e)
        for e in events
        if e.get("ph") == "X" and e.get("cat") in cats
    )


def idle_gaps(gpu: list[tuple[float, float, Any]], min_us: float) -> list[tuple[float, float]]:
    """Gaps longer than min_us between the union of GPU intervals, first to last."""
    gaps, end = [], None
    for start, stop, _ in gpu:
        if end is not None and start - end > min_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    return gaps


def gaps_of_trace(trace: dict[str, Any], min_us: float = 20.0, top: int = 40) -> dict[str, Any]:
    events = trace.get("traceEvents", [])
    gpu = _intervals(events, GPU_CATEGORIES)
    if not gpu:
        return {"gaps": 0}
    gaps = idle_gaps(gpu, min_us)
    span = max(stop for _, stop, _ in gpu) - gpu[0][0]
    busy_in: dict[tuple[str, str], float] = defaultdict(float)
    for start, stop, ev in _intervals(events, HOST_CATEGORIES):
        for g0, g1 in gaps:
            overlap = min(stop, g1) - max(start, g0)
            if overlap > 0:
                busy_in[(ev["cat"], ev["name"][:120])] += overlap
    ranked = sorted(busy_in.items(), key=lambda kv: -kv[1])[:top]
    return {
        "span_us": round(span, 1),
        "idle_us": round(sum(g1 - g0 for g0, g1 in gaps), 1),
        "gaps": [{"at_us": round(g0 - gpu[0][0], 1), "us": round(g1 - g0, 1)} for g0, g1 in gaps],
        "host_in_gaps_us": [{"cat": c, "name": n, "us": round(us, 1)} for (c, n), us in ranked],
    }


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    print(json.dumps(gaps_of_trace(json.loads(raw)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
