"""The EAGLE-1 head, trained on the frozen target exactly as the engine runs it.

Alignment (spec/eagle_worker.py, engine/models/eagle.py): at position p the head gets the target's
final normed hidden state h[p] and the token x[p+1]; its output g[p] goes through the target's LM
head (no norm) to predict x[p+2], and is fed back as the feature at position p+1 when drafting.
So g[p] is trained towards h[p+1] (smooth L1) and its logits towards the target's own next-token
distribution at p+1 (distillation).

Training-time test: step k > 1 feeds the head its own step k-1 output from position p-1 instead
of h[p], and attends as a chain draft does at inference: to step-1 keys (the committed draft KV)
at positions <= p-k+1, then to the step-j key at position p-k+j for j = 2..k (the drafted chain).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from trainer.data import heldout_windows, sample_windows
from trainer.layers import DecoderLayer, LlamaShape, init_weights, rope_tables
from trainer.loop import Schedule, autocast, train_loop
from trainer.target import TrainLlama


class TrainEagleHead(nn.Module):
    """Parameter names as engine.models.eagle.EagleHead loads them: fc.*, layers.0.*."""

    def __init__(self, s: LlamaShape, input_norm: bool = True) -> None:
        super().__init__()
        self.shape = s
        self.fc = nn.Linear(2 * s.hidden, s.hidden, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(s, input_norm=input_norm)])
        cos, sin = rope_tables(s.head_dim, s.max_positions, s.rope_theta, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def unrolled(self, emb: torch.Tensor, feat: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Outputs of `steps` chained draft steps over every position: list of (batch, T, hidden)."""
        layer = self.layers[0]
        attn = layer.self_attn
        t = emb.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs: list[torch.Tensor] = []
        for k in range(1, steps + 1):
            if k > 1:  # own previous output from one position earlier (position 0: no anchor)
                feat = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            x = self.fc(torch.cat((emb, feat.to(emb.dtype)), dim=-1))
            q, key, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            keys.append((key, v))
            if k == 1:
                o = F.scaled_dot_product_attention(q, key, v, is_causal=True)
            else:
                o = _chain_attention(q, keys)
            h = x + attn.out(o)
            outs.append(h + layer.mlp(layer.post_attention_layernorm(h)))
        return outs


def _chain_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Step k = len(keys): causal over step-1 keys up to p-k+1, plus one diagonal key per later step."""
    k = len(keys)
    t = q.shape[2]
    scale = q.shape[-1] ** -0.5
    k1, v1 = keys[0]
    scores = torch.matmul(q, k1.transpose(-1, -2)).float() * scale
    idx = torch.arange(t, device=q.device)
    causal = idx.unsqueeze(0) <= idx.unsqueeze(1) - (k - 1)  # [query, key]
    scores = scores.masked_fill(~causal, float("-inf"))
    diag_s, diag_v = [], []
    for j in range(2, k + 1):
        shift = k - j  # the step-j key at position p - shift
        kj, vj = keys[j - 1]
        kj = F.pad(kj, (0, 0, shift, 0))[:, :, :t]
        diag_v.append(F.pad(vj, (0, 0, shift, 0))[:, :, :t])
        s = (q * kj).sum(-1).float() * scale
        diag_s.append(s.masked_fill(idx < shift, float("-inf")))
    probs = torch.softmax(torch.cat((scores, torch.stack(diag_s, -1)), dim=-1), dim=-1).to(v1.dtype)
    out = torch.matmul(probs[..., :t], v1)
    for j, vj in enumerate(diag_v):
        out = out + probs[..., t + j : t + j + 1] * vj
    return out


def build_head(
    target: TrainLlama, intermediate: int, seed: int, device: torch.device, input_norm: bool = True
) -> TrainEagleHead:
    ts = target.shape
    s = LlamaShape(
        hidden=ts.hidden,
        layers=1,
        heads=ts.heads,
        kv_heads=ts.kv_heads,
        intermediate=intermediate,
        vocab=ts.vocab,
        max_positions=ts.max_positions,
        rope_theta=ts.rope_theta,
        rms_eps=ts.rms_eps,
    )
    head = TrainEagleHead(s, input_norm=input_norm)
    init_weights(head, 1, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():  # start as the "repeat" head: output ~ input feature
        head.fc.weight[:, s.hidden :] += torch.eye(s.hidden)
    return head.to(device)


def _batch_losses(
    head: TrainEagleHead, target: TrainLlama, win: torch.Tensor, steps: int, reg_weight: float, decay: float
) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over the unrolled steps, and each step's top-1 agreement with the target."""
    with torch.no_grad():
        h = target.hidden(win)
        probs = torch.softmax(target.logits(h[:, 1:]).float(), dim=-1)
        emb = target.model.embed_tokens(win[:, 1:])
    outs = head.unrolled(emb, h[:, :-1], steps)
    want = probs.argmax(-1)
    total, weights, agree = win.new_zeros((), dtype=torch.float32), 0.0, []
    for k, g in enumerate(outs, start=1):
        sl = slice(k - 1, None)  # positions with a full chain behind them
        logp = torch.log_softmax(target.logits(g[:, sl]).float(), dim=-1)
        ce = -(probs[:, sl] * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(g[:, sl].float(), h[:, 1:][:, sl].float())
        w = decay ** (k - 1)
        total, weights = total + w * (ce + reg_weight * reg), weights + w
        agree.append(float((logp.argmax(-1) == want[:, sl]).float().mean()) if not head.training else 0.0)
    return total / weights, agree


def head_agreement(
    head: TrainEagleHead,
    target: TrainLlama,
    stream: torch.Tensor,
    ctx: int,
    device: torch.device,
    steps: int,
    max_windows: int = 16,
) -> dict[str, object]:
    """Held-out top-1 agreement with the target per chained step, and the chain's expected length."""
    head.eval()
    sums, n = [0.0] * steps, 0
    with torch.no_grad():
        for win in heldout_windows(stream, ctx, 4, max_windows):
            with autocast(device):
                _, agree = _batch_losses(head, target, win.to(device), steps, 0.0, 1.0)
            sums = [s + a * len(win) for s, a in zip(sums, agree)]
            n += len(win)
    per_step = [s / max(1, n) for s in sums]
    expected, run = 1.0, 1.0
    for a in per_step:  # rough: treats step k's agreement as conditional on the earlier ones
        run *= a
        expected += run
    return {"top1_agreement": per_step, "expected_accept_len": expected}


def train_head(
    head: TrainEagleHead,
    target: TrainLlama,
    train_stream: torch.Tensor,
    *,
    sched: Schedule,
    batch: int,
    ctx: int,
    seed: int,
    device: torch.device,
    log: Callable[[str], None],
    progress: bool,
    ttt_steps: int = 3,
    reg_weight: float = 0.5,
    decay: float = 0.8,
) -> dict[str, object]:
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    gen = torch.Generator().manual_seed(seed + 2)

    def step_fn(_step: int) -> tuple[torch.Tensor, int]:
        win = sample_windows(train_stream, batch, ctx, gen).to(device, non_blocking=True)
        with autocast(device):
            loss, _ = _batch_losses(head, target, win, ttt_steps, reg_weight, decay)
        return loss, batch * ctx

    return train_loop(head, step_fn, sched, device, desc="eagle head", log=log, progress=progress)


def hf_tensors(head: TrainEagleHead, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
