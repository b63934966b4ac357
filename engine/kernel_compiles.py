"""Triton JIT compiles in this process, counted, and timed by kernel (node metrics).

A kernel meets a new specialization (an integer argument that turns 1 or a multiple of 16, a new
constexpr) the first time a batch of that shape runs eagerly, and the step that meets it waits
for the compile, or for the load from Triton's disk cache on a warm machine. Start-up warms the
shapes it knows; one that first appears under load stalls every stream on the node for as long
as the compile takes. These counters say whether that happened, and for which kernel.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from prometheus_client import Counter

log = logging.getLogger(__name__)

# the count is unlabelled, so a node that never compiles (CPU) still exports it at 0; the seconds
# name the kernels
KERNEL_COMPILES = Counter(
    "pdserve_node_kernel_compiles",
    "Triton kernels compiled (or loaded from Triton's disk cache) in this process: one after "
    "start-up stalled the step that needed it",
)
KERNEL_COMPILE_SECONDS = Counter(
    "pdserve_node_kernel_compile_seconds",
    "Seconds the process spent compiling or loading Triton kernels, by kernel",
    ["kernel"],
)
SLOW_COMPILE_S = 0.05  # a compile while serving that long is logged: streams stood still meanwhile

JITHook = Callable[..., Any]


class CompileCounter:
    """Times each compile between Triton's pre- and post-compile hooks (called in that order, on
    the compiling thread) and counts it; hooks installed before are still called."""

    def __init__(self, before: JITHook | None = None, after: JITHook | None = None) -> None:
        self._chained_before, self._chained_after = before, after
        self._started = threading.local()
        self.serving = False  # set once the node is up: later compiles are logged when slow

    def before(self, **kwargs: Any) -> bool | None:
        self._started.at = time.perf_counter()
        # a truthy answer would tell Triton to skip the compile: only a chained hook may say so
        return self._chained_before(**kwargs) if self._chained_before is not None else None

    def after(self, **kwargs: Any) -> Any:
        now = time.perf_counter()
        self.record(kernel_name(kwargs.get("fn")), now - getattr(self._started, "at", now))
        return self._chained_after(**kwargs) if self._chained_after is not None else None

    def record(self, kernel: str, seconds: float) -> None:
        KERNEL_COMPILES.inc()
        KERNEL_COMPILE_SECONDS.labels(kernel).inc(seconds)
        if self.serving and seconds >= SLOW_COMPILE_S:
            log.warning("compiled Triton kernel %s while serving: %.0f ms", kernel, seconds * 1e3)


def kernel_name(fn: Any) -> str:
    """The kernel's name from Triton's hook argument (a JitFunctionInfo: module, name, jit_function;
    read leniently, as Triton's hook arguments are not a stable API)."""
    name = getattr(fn, "name", None)
    return str(name) if name else "unknown"


_installed: CompileCounter | None = None


def install() -> CompileCounter:
    """Hook this process's Triton JIT (once; later calls return the same counter)."""
    global _installed
    if _installed is None:
        from triton import knobs

        runtime = knobs.runtime
        _installed = CompileCounter(runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = _installed.before
        runtime.jit_post_compile_hook = _installed.after
    return _installed
