"""A synthetic-acceptance EAGLE-3 draft for speed measurements on random-weight targets.

Random weights make a real head's drafts all wrong. Here the head still does all of its work
(every draft step and draft-extend forward, its logits over the draft vocabulary), then its choice
is replaced: with probability p by the target's own next token, known from a plain greedy run of
the same prompts (an oracle table indexed by request slot and position), otherwise by a token that
is surely wrong. Verification is the real one, so output must still equal plain decoding; p sets
how many drafts a verify accepts (1 + p + p^2 + ... per chain).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core import Req
from engine.noise import uniform_noise
from spec.api import CustomSpecAlgo, EngineParts, SpecConfig, SpeculativeAlgorithm
from spec.eagle_worker import EagleWorker

_SALT = 0x5EED


class OraclePicker:
    """Drafts from the plain run's tokens, right with probability `p` per position."""

    def __init__(self, max_reqs: int, max_context: int, vocab: int, device: torch.device) -> None:
        self.table = torch.zeros(max_reqs + 1, max_context, dtype=torch.int64, device=device)
        self.vocab, self.p = vocab, 0.0
        self.sequences: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + plain output
        self._threshold = torch.zeros((), dtype=torch.float32, device=device)

    def set_p(self, p: float) -> None:
        self.p = p
        self._threshold.fill_(p)  # a device scalar: captured graphs read it at replay

    def on_admit(self, req: Req) -> None:
        seq = self.sequences.get(tuple(req.prompt_ids))
        row = self.table[req.slot]
        row.zero_()
        if seq is not None:
            n = min(len(seq), row.shape[0])
            row[:n] = torch.tensor(seq[:n], device=row.device)

    def _oracle(self, own: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(rows,) the true token at each row's position with probability p, else a wrong one."""
        pos = positions.clamp(max=self.table.shape[1] - 1)
        true = self.table[slots, pos]
        coin = uniform_noise(slots + _SALT, pos, 1).squeeze(1) < self._threshold  # independent per position
        return torch.where(coin, true, (true + 1) % self.vocab)  # `own` was computed: its cost is paid

    def pick(
        self, head: torch.nn.Module, hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        own = head.to_target_ids(head.compute_logits(hidden).argmax(-1))  # the head's full cost
        return self._oracle(own, slots, positions)

    def guess(
        self, head: torch.nn.Module, hidden: torch.Tensor, k: int, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(head.compute_logits(hidden).float(), dim=-1)
        p, idx = torch.topk(probs, k, dim=-1)
        idx = head.to_target_ids(idx)
        first = self._oracle(idx[:, 0], slots, positions)
        return p, torch.cat((first.unsqueeze(1), idx[:, 1:]), dim=1)


def widen_margins(
    model: torch.nn.Module, residual_scale: float = 1e-3, embedding_scale: float = 5.0, seed: int = 0
) -> None:
    """Random weights whose greedy next token wins by a wide logit margin, as a trained model's
    mostly does: embeddings scaled up and residual branches down, so the last hidden state stays
    near the current token's embedding (the branches add ~15% of its norm over 32 layers), and the
    lm_head rows a permutation of the embeddings (identity when tied). bf16 kernels of different
    shapes (a decode GEMV, a verify window's GEMM) then agree on every greedy token, so
    speculative output equals plain output and the oracle's table stays right; with plain random
    weights near-ties flip a few tokens per hundred. Compute is unchanged."""
    model.requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(residual_scale)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.mul_(embedding_scale)
        if head.data_ptr() != emb.data_ptr():
            gen = torch.Generator(device=emb.device).manual_seed(seed)
            head.copy_(emb[torch.randperm(emb.shape[0], generator=gen, device=emb.device)])


PICKER: dict[str, OraclePicker] = {}  # the bench installs one before building an engine


class SyntheticEagle3(CustomSpecAlgo):
    """EAGLE-3 with the oracle picker (registered by the bench as SYNTHETIC)."""

    def build_disagg_draft_input(self, batch: Any, config: SpecConfig, last_tokens: Any, future_map: Any) -> Any:
        return SpeculativeAlgorithm.EAGLE3.build_disagg_draft_input(batch, config, last_tokens, future_map)

    def create_worker(self, parts: EngineParts, config: SpecConfig) -> EagleWorker:
        return EagleWorker.create(parts, config, "eagle3", self, picker=PICKER["current"])
