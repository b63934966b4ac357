"""Triton JIT compiles counted and timed by kernel (engine/kernel_compiles.py): the hooks keep what
was installed before, a compile while serving is logged, and on a GPU a kernel's first launch at a
new specialization is counted."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
import triton
import triton.language as tl
from prometheus_client import REGISTRY

from engine import kernel_compiles
from engine.kernel_compiles import CompileCounter


def _count() -> float:
    return REGISTRY.get_sample_value("pdserve_node_kernel_compiles_total") or 0.0


def _seconds(kernel: str) -> float:
    return REGISTRY.get_sample_value("pdserve_node_kernel_compile_seconds_total", {"kernel": kernel}) or 0.0


def test_a_compile_between_the_hooks_is_counted_and_timed_by_kernel() -> None:
    chained: list[str] = []
    counter = CompileCounter(
        before=lambda **kw: chained.append("before") or None, after=lambda **kw: chained.append("after")
    )
    fn = SimpleNamespace(module="engine.layers.triton_ops", name="_test_rmsnorm_kernel", jit_function=None)
    count, seconds = _count(), _seconds("_test_rmsnorm_kernel")
    assert not counter.before(key="k", fn=fn)  # falsy: Triton goes on to compile it
    counter.after(key="k", fn=fn)
    assert chained == ["before", "after"]  # hooks installed before ours still run
    assert _count() == count + 1
    assert _seconds("_test_rmsnorm_kernel") > seconds


def test_a_slow_compile_while_serving_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    counter = CompileCounter()
    with caplog.at_level(logging.WARNING, logger="engine.kernel_compiles"):
        counter.record("_test_warmup_kernel", 0.4)  # start-up's compiles are expected: not logged
        counter.serving = True
        counter.record("_test_extend_kernel", 0.01)  # quick (a load from the disk cache): not logged
        counter.record("_test_extend_kernel", 0.3)
    assert [r.getMessage() for r in caplog.records] == [
        "compiled Triton kernel _test_extend_kernel while serving: 300 ms"
    ]


@pytest.fixture
def hooks() -> Iterator[Any]:
    """Triton's JIT hooks as they were, restored afterwards with the module's counter."""
    from triton import knobs

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, kernel_compiles._installed
    kernel_compiles._installed = None
    try:
        yield knobs.runtime
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, kernel_compiles._installed = saved


def test_install_hooks_the_jit_once(hooks: Any) -> None:
    counter = kernel_compiles.install()
    assert hooks.jit_cache_hook == counter.before and hooks.jit_post_compile_hook == counter.after
    assert kernel_compiles.install() is counter  # a second call installs nothing more


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


@pytest.mark.gpu
def test_gpu_a_new_specialization_is_compiled_once_and_counted(hooks: Any) -> None:
    kernel_compiles.install()
    before = _count(), _seconds("_add_one_kernel")
    x = torch.zeros(48, device="cuda")
    _add_one_kernel[(1,)](x, 47, BLOCK=64)  # n not a multiple of 16
    _add_one_kernel[(1,)](x, 45, BLOCK=64)  # the same specialization: no compile
    _add_one_kernel[(1,)](x, 48, BLOCK=64)  # a multiple of 16: a new one
    torch.cuda.synchronize()
    assert _count() - before[0] == 2 and _seconds("_add_one_kernel") > before[1]
