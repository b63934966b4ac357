"""Fixtures of the engine tests: a started engine loop on the tiny Llama."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.engine import Engine, EngineConfig
from engine.loop import EngineLoop, ThreadedIO


@pytest.fixture
def loop(tiny_llama_dir) -> Iterator[EngineLoop]:
    eng = Engine(EngineConfig(str(tiny_llama_dir), page_size=4), io=ThreadedIO())
    lp = EngineLoop(eng).start()
    yield lp
    lp.stop()
