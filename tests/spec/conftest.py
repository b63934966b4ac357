"""Shared fixture for the speculative tests: a tiny target and an EAGLE head that repeats it."""

from __future__ import annotations

import pytest

from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """(target dir, EAGLE head dir): the head proposes what the target would say, so drafts are
    accepted often and every acceptance length shows up."""
    root = tmp_path_factory.mktemp("eagle-pair")
    target = write_tiny_model(root / "t", seed=1)
    return target, write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat")
