"""The built-in model pair (a small Python-code Llama and its trained EAGLE head) and the defaults
every command applies when no --model is given."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
BUILTIN_TARGET = MODELS_DIR / "pycoder"  # the directory name is the model id the router serves
BUILTIN_DRAFT = MODELS_DIR / "pycoder-eagle"
# The head was trained for chained drafts of this length (pdserve/train, bench/RESULTS.md).
BUILTIN_DRAFT_STEPS = 4


@dataclass(frozen=True)
class ModelChoice:
    """What to load: the target, its dtype, and the speculative settings that go with it."""

    model: Path
    dtype: str | None
    algorithm: str
    draft_model_path: Path | None
    num_steps: int | None


def resolve(model: Path | str | None, *, algorithm: str | None, draft_model_path: Path | str | None,
            num_steps: int | None, dtype: str | None, device: str) -> ModelChoice:
    """No --model: the built-in pair, with EAGLE on unless --speculative-algorithm says otherwise,
    and float32 on a CPU (its bf16 weights run faster and without near-tie flips in fp32 there).
    With --model: exactly what was asked (no speculation unless requested)."""
    if model is not None:
        return ModelChoice(Path(model), dtype, algorithm or "NONE",
                           Path(draft_model_path) if draft_model_path else None, num_steps)
    if dtype is None and device.split(":")[0] == "cpu":
        dtype = "float32"
    algo = algorithm or "EAGLE"
    builtin_head = algo.upper() == "EAGLE" and draft_model_path is None
    return ModelChoice(BUILTIN_TARGET, dtype, algo,
                       BUILTIN_DRAFT if builtin_head else (Path(draft_model_path) if draft_model_path else None),
                       num_steps if num_steps is not None or not builtin_head else BUILTIN_DRAFT_STEPS)

