"""Fixtures of the engine tests: a started engine loop on the tiny Llama, and the graph tests' rig."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine import Engine, EngineConfig
from engine.loop import EngineLoop, ThreadedIO
from fixtures.tiny_eagle import write_tiny_eagle_head
from tests.engine.graph_rig import Rig


@pytest.fixture
def loop(tiny_llama_dir) -> Iterator[EngineLoop]:
    eng = Engine(EngineConfig(str(tiny_llama_dir), page_size=4), io=ThreadedIO())
    lp = EngineLoop(eng).start()
    yield lp
    lp.stop()


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return write_tiny_eagle_head(tmp_path_factory.mktemp("head"), tiny_llama_dir, "eagle", mode="random")


@pytest.fixture(scope="module")
def cpu_rig(tiny_llama_dir, head_dir) -> Rig:
    return Rig(tiny_llama_dir, head_dir)


@pytest.fixture
def rig(cpu_rig):
    """The module's CPU rig with graphs off and every request released after each test."""
    yield cpu_rig
    for runner in (cpu_rig.target, cpu_rig.draft):
        runner.disable_cuda_graphs()
    cpu_rig.release(cpu_rig.live)
