"""`pdserve train`'s settings (torch-free, so the CLI can build its flags without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.flag_fields import opt


@dataclass(frozen=True)
class TrainOptions:
    """What `trainer.main.train_pair` is asked for; unset (None) sizes come from the preset."""

    out: Path = opt(..., "Output directory (target/, eagle/, train_meta.json).")
    seed: int = opt(0, "Seed for everything (the run is deterministic from it).")
    device: str = opt("auto", "auto, cpu, cuda, cuda:1, ...")
    preset: Optional[str] = opt(None, "Model size: full, medium or tiny (default: full).")
    tiny: bool = opt(False, "Same as --preset tiny.", negatable=False)
    target_steps: Optional[int] = opt(None, "Target training steps.")
    head_steps: Optional[int] = opt(None, "EAGLE head training steps.")
    batch_size: Optional[int] = opt(None, "Target windows per step.")
    head_batch_size: Optional[int] = opt(None, "Head windows per step.")
    target_lr: Optional[float] = opt(None, "Target learning rate.")
    head_lr: Optional[float] = opt(None, "Head learning rate.")
    vocab_size: Optional[int] = opt(None, "Tokenizer vocabulary size.")
    ttt_steps: int = opt(4, "Chained draft steps trained per batch.")
    eval_prompts: Optional[int] = opt(None, "Held-out prompts for the acceptance measurement (0: skip).")
    eval_every: int = opt(0, "Held-out loss every N target steps (0: off).")
    eval_dtype: str = opt("float32", "Engine dtype of the acceptance run.")
    progress: bool = opt(True, "Show training progress.")
