"""The built-in model pair (a small Python-code Llama and its trained EAGLE head) and the defaults
every command applies when no --model is given."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
# Which directories form the pair, which algorithm the head was trained for, and its draft length
# (trainer, bench/RESULTS.md): data, so no code here names an algorithm.
PAIR = json.loads((MODELS_DIR / "pair.json").read_text())
BUILTIN_TARGET = MODELS_DIR / PAIR["target"]  # the directory name is the model id the router serves
BUILTIN_DRAFT = MODELS_DIR / PAIR["draft"]
BUILTIN_ALGORITHM: str = PAIR["speculative_algorithm"]
BUILTIN_DRAFT_STEPS: int = PAIR["num_steps"]


@dataclass(frozen=True)
class ModelChoice:
    """What to load: the target, its dtype, and the speculative settings that go with it."""

    model: Path
    dtype: str | None
    algorithm: str | None  # None: the registry's default (no speculation)
    draft_model_path: Path | None
    num_steps: int | None


def resolve(
    model: Path | str | None,
    *,
    algorithm: str | None,
    draft_model_path: Path | str | None,
    num_steps: int | None,
    dtype: str | None,
    device: str,
    adaptive: bool = False,
) -> ModelChoice:
    """No --model: the built-in pair, with its head's algorithm on unless --speculative-algorithm
    says otherwise, and float32 on a CPU (its bf16 weights run faster and without near-tie flips
    in fp32 there). With --model: exactly what was asked (no speculation unless requested)."""
    if model is not None:
        return ModelChoice(
            Path(model), dtype, algorithm, Path(draft_model_path) if draft_model_path else None, num_steps
        )
    if dtype is None and device.split(":")[0] == "cpu":
        dtype = "float32"
    algo = algorithm or BUILTIN_ALGORITHM
    builtin_head = algo.upper() == BUILTIN_ALGORITHM.upper() and draft_model_path is None
    return ModelChoice(
        BUILTIN_TARGET,
        dtype,
        algo,
        BUILTIN_DRAFT if builtin_head else (Path(draft_model_path) if draft_model_path else None),
        # under adaptive steps the policy picks them (from its candidates)
        num_steps if num_steps is not None or not builtin_head or adaptive else BUILTIN_DRAFT_STEPS,
    )
