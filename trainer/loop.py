"""The optimisation loop shared by target and head: AdamW, warmup + cosine, clipping, progress."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn


@dataclass(frozen=True)
class Schedule:
    steps: int
    lr: float
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def lr_at(self, step: int) -> float:
        warm = min(self.warmup, max(1, self.steps // 10))
        if step < warm:
            return self.lr * (step + 1) / warm
        frac = (step - warm) / max(1, self.steps - warm)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def autocast(device: torch.device) -> ContextManager[object]:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU, where bf16 is slow."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(model: nn.Module, sched: Schedule, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # No decay on norms and biases, as usual; matrices (embeddings included) decay.
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": sched.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=sched.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


StepFn = Callable[[int], tuple[torch.Tensor, int]]  # step -> (loss, tokens in the batch)
EvalFn = Callable[[], dict[str, float]]


def train_loop(
    model: nn.Module,
    step_fn: StepFn,
    sched: Schedule,
    device: torch.device,
    *,
    desc: str,
    log: Callable[[str], None],
    eval_fn: EvalFn | None = None,
    eval_every: int = 0,
    log_every: int = 50,
    progress: bool = True,
) -> dict[str, object]:
    """Run `sched.steps` optimizer steps; returns loss history, evals, tokens and seconds."""
    opt = make_optimizer(model, sched, device)
    params = [p for g in opt.param_groups for p in g["params"]]
    history: list[tuple[int, float]] = []
    evals: list[dict[str, float]] = []
    tokens, ema, start = 0, None, time.perf_counter()
    model.train()
    with _progress(desc, sched.steps, progress) as advance:
        for step in range(sched.steps):
            for g in opt.param_groups:
                g["lr"] = sched.lr_at(step)
            loss, n = step_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, sched.grad_clip)
            opt.step()
            tokens += n
            if step % log_every == 0 or step == sched.steps - 1:
                value = float(loss.detach())  # syncs the device: only every log_every steps
                ema = value if ema is None else 0.7 * ema + 0.3 * value
                history.append((step, value))
                log(
                    f"{desc} step {step + 1}/{sched.steps} loss {value:.4f} lr {sched.lr_at(step):.2e} "
                    f"{tokens / (time.perf_counter() - start):,.0f} tok/s"
                )
            advance(f"{desc} loss {ema if ema is not None else float('nan'):.3f}")
            if eval_fn is not None and eval_every and (step + 1) % eval_every == 0 and step + 1 < sched.steps:
                evals.append({"step": step + 1, **eval_fn()})
                log(f"{desc} eval at step {step + 1}: {evals[-1]}")
                model.train()
    model.eval()
    return {
        "loss_history": history,
        "evals": evals,
        "tokens": tokens,
        "seconds": time.perf_counter() - start,
        "final_train_loss": history[-1][1] if history else float("nan"),
    }


@contextlib.contextmanager
def _progress(desc: str, total: int, enabled: bool):  # type: ignore[no-untyped-def]
    """A rich progress bar (a no-op when disabled, e.g. in tests)."""
    if not enabled:
        yield lambda _text: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as prog:
        task = prog.add_task(desc, total=total)
        yield lambda text: prog.update(task, advance=1, description=text)
