"""Device ceilings measured in the same run as the engine: copy bandwidth and the bf16 matmul rate."""

from __future__ import annotations

import time
from typing import Callable

import torch


def time_cuda(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Mean seconds per call, timed with CUDA events around `iters` back-to-back calls
    (wall clock without CUDA, so the benchmark code can be dry-run on a CPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph, for timing work of a few microseconds that the host's launches
    would otherwise hide; fn itself where it cannot be captured (or without CUDA)."""
    if not torch.cuda.is_available():
        return fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except RuntimeError:
        torch.cuda.synchronize()
        return fn


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    secs = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * nbytes / secs


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of an n^3 bf16 matmul on random data (zeros run faster and would flatter us)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    secs = time_cuda(lambda: torch.matmul(a, b, out=out), iters=20)
    return 2 * n**3 / secs


def burst_and_held(fn: Callable[[], object], seconds: float = 1.0) -> tuple[float, float]:
    """Seconds a call of fn over a 20-call burst, and over calls held for about `seconds`: a GPU
    at its power limit clocks lower once the work is held (an H200 at 700 W: 1.47-1.6 GHz instead
    of the burst's 1.98, bench/RESULTS.md)."""
    burst = time_cuda(fn, iters=20)
    return burst, time_cuda(fn, iters=max(20, int(seconds / burst)))


def sustained_matmul_rate(device: torch.device, n: int = 8192, seconds: float = 1.0) -> float:
    """The matmul rate's matmul held for about `seconds`, as long as a benchmark's repeated
    prompts run."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    _, secs = burst_and_held(lambda: torch.matmul(a, b, out=out), seconds)
    return 2 * n**3 / secs
