"""The built-in model pair: defaults when no --model is given, size limits, and that it serves
Python-looking completions with a trained draft (greedy speculative output == plain output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.models import BUILTIN_DRAFT, BUILTIN_DRAFT_STEPS, BUILTIN_TARGET, resolve

PROMPT = 'import os\n\n\ndef list_python_files(root):\n    """Return the .py files under root."""\n'


def test_no_model_means_the_builtin_pair_with_eagle() -> None:
    choice = resolve(None, algorithm=None, draft_model_path=None, num_steps=None, dtype=None, device="cpu")
    assert (choice.model, choice.algorithm, choice.draft_model_path) == (BUILTIN_TARGET, "EAGLE", BUILTIN_DRAFT)
    assert choice.num_steps == BUILTIN_DRAFT_STEPS and choice.dtype == "float32"
    off = resolve(None, algorithm="NONE", draft_model_path=None, num_steps=None, dtype=None, device="cpu")
    assert off.algorithm == "NONE" and off.draft_model_path is None
    gpu = resolve(None, algorithm=None, draft_model_path=None, num_steps=None, dtype=None, device="cuda:0")
    assert gpu.dtype is None  # the checkpoint's bf16 on GPUs
    own = resolve("/some/model", algorithm=None, draft_model_path=None, num_steps=None, dtype=None, device="cpu")
    assert own.model == Path("/some/model") and own.algorithm is None  # the registry's default: no speculation


def test_pair_fits_the_size_budget() -> None:
    files = [p for d in (BUILTIN_TARGET, BUILTIN_DRAFT) for p in d.iterdir()]
    assert max(p.stat().st_size for p in files) <= 15_000_000
    assert sum(p.stat().st_size for p in files) <= 25_000_000


@pytest.fixture(scope="module")
def engines():
    from engine.engine import Engine, EngineConfig
    from spec.config import SpecConfig
    from spec.registry import bind

    cfg = EngineConfig(str(BUILTIN_TARGET), dtype="float32", page_size=16)
    spec = SpecConfig("EAGLE", str(BUILTIN_DRAFT), BUILTIN_DRAFT_STEPS, 1)
    return Engine(cfg), Engine(cfg, algorithm=bind(spec))


def test_pair_completes_python_and_the_draft_is_trained(engines) -> None:
    from engine.core import SamplingParams

    plain, eagle = engines
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    want = plain.generate([PROMPT], params)[0]
    got = eagle.generate([PROMPT], params)[0]
    assert got.output_ids == want.output_ids  # greedy speculative == greedy plain
    assert any(word in want.text for word in ("def ", "return", "self", "import", "os."))
    per_verify = sum(a + 1 for a in got.accepted_drafts) / len(got.accepted_drafts)
    assert per_verify > 1.5, got.accepted_drafts  # a trained head: random heads accept ~nothing
