"""The target: a small Llama (tied embeddings, GQA) trained from scratch on packed sequences."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from engine.layers.norm import RMSNorm
from trainer.data import heldout_windows, sample_windows
from trainer.layers import DecoderLayer, LlamaShape, init_weights, rope_tables
from trainer.loop import Schedule, autocast, train_loop


class _Backbone(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.rms_eps)


class TrainLlama(nn.Module):
    """Parameter names are HF's (`model.layers.0.self_attn.q_proj.weight`, ...); the LM head is
    the embedding (tied), so the checkpoint has no `lm_head.weight`."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.shape = s
        self.model = _Backbone(s)
        cos, sin = rope_tables(s.head_dim, s.max_positions, s.rope_theta, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Final *normed* hidden states (batch, tokens, hidden): what the engine feeds EAGLE."""
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.embed_tokens.weight)

    def loss(self, window: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over a (batch, tokens + 1) window."""
        logits = self.logits(self.hidden(window[:, :-1]))
        return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


def build_target(s: LlamaShape, seed: int, device: torch.device) -> TrainLlama:
    model = TrainLlama(s)
    init_weights(model, s.layers, torch.Generator().manual_seed(seed))
    return model.to(device)


@torch.no_grad()
def heldout_loss(
    model: TrainLlama,
    stream: torch.Tensor,
    ctx: int,
    device: torch.device,
    batch: int = 8,
    max_windows: int | None = None,
) -> float:
    """Mean next-token loss over consecutive held-out windows (token-weighted)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for win in heldout_windows(stream, ctx + 1, batch, max_windows):
        win = win.to(device)
        with autocast(device):
            logits = model.logits(model.hidden(win[:, :-1]))
        total += float(F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum"))
        count += win[:, 1:].numel()
    model.train(was_training)
    return total / max(1, count)


def train_target(
    model: TrainLlama,
    train_stream: torch.Tensor,
    test_stream: torch.Tensor,
    *,
    sched: Schedule,
    batch: int,
    ctx: int,
    seed: int,
    device: torch.device,
    log: Callable[[str], None],
    progress: bool,
    eval_every: int = 0,
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)

    def step_fn(_step: int) -> tuple[torch.Tensor, int]:
        win = sample_windows(train_stream, batch, ctx + 1, gen).to(device, non_blocking=True)
        with autocast(device):
            return model.loss(win), batch * ctx

    def eval_fn() -> dict[str, float]:
        return {"heldout_loss": heldout_loss(model, test_stream, ctx, device, max_windows=64)}

    result = train_loop(
        model, step_fn, sched, device, desc="target", log=log, eval_fn=eval_fn, eval_every=eval_every, progress=progress
    )
    result["heldout_loss"] = heldout_loss(model, test_stream, ctx, device)
    log(f"target held-out loss {result['heldout_loss']:.4f} (train {result['final_train_loss']:.4f})")
    return result


def hf_tensors(model: TrainLlama, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, named as transformers names them."""
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
