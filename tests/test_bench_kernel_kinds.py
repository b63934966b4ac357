"""Splitting a profiled step's kernel time by kind (bench/gpu/engine_perf.py): what a tensor-parallel
step spends in NCCL against the matmuls and attention, from a Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu.engine_perf import kernel_us_by_kind


def test_kernels_are_summed_by_kind_per_step(tmp_path: Path) -> None:
    kernels = [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 20.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 100.0),
        ("_gemv_kernel", 30.0),
        ("_split_kernel", 12.0),
        ("_merge_kernel", 2.0),
        ("_rmsnorm_kernel", 4.0),
    ]
    events = [{"cat": "kernel", "name": n, "ts": i * 200.0, "dur": d} for i, (n, d) in enumerate(kernels * 2)]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 999.0})  # host ops do not count
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    split = kernel_us_by_kind(trace, steps=2)
    assert split == {
        "all-reduce": pytest.approx(20.0),
        "matmul": pytest.approx(130.0),
        "attention": pytest.approx(14.0),
        "other": pytest.approx(4.0),
    }
