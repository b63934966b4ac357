"""bench/gpu/trace_gaps.py: the GPU's idle gaps in a Chrome trace and the host work inside them."""

from __future__ import annotations

from bench.gpu.trace_gaps import gaps_of_trace, idle_gaps


def _x(cat: str, name: str, ts: float, dur: float) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_gaps_between_overlapping_gpu_work_and_the_host_inside_them() -> None:
    trace = {
        "traceEvents": [
            _x("kernel", "a", 0, 10),
            _x("gpu_memcpy", "copy", 5, 10),  # overlaps a: one busy interval to 15
            _x("kernel", "b", 100, 10),  # an 85 us gap
            _x("kernel", "c", 115, 10),  # 5 us: under the threshold
            _x("python_function", "engine/step", 0, 200),
            _x("python_function", "engine/admit", 20, 30),
            _x("cuda_runtime", "cudaGraphLaunch", 90, 20),
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 50},  # not a duration event
        ]
    }
    out = gaps_of_trace(trace, min_us=20)
    assert out["span_us"] == 125 and out["idle_us"] == 85
    assert out["gaps"] == [{"at_us": 15, "us": 85}]
    host = {h["name"]: h["us"] for h in out["host_in_gaps_us"]}
    assert host == {"engine/step": 85, "engine/admit": 30, "cudaGraphLaunch": 10}


def test_no_gpu_work_and_no_gaps() -> None:
    assert gaps_of_trace({"traceEvents": [_x("python_function", "f", 0, 5)]}) == {"gaps": 0}
    assert idle_gaps([(0.0, 10.0, None), (12.0, 20.0, None)], min_us=5) == []
