"""The embedding table and LM head split by vocabulary rows over tensor-parallel ranks.

With one rank they are a plain embedding lookup and a plain linear. With several, each rank holds
one block of ceil(V / size) rows (the last zero-padded): the lookup zeroes ids outside the block
and the ranks sum (all-reduce); the head computes its block's logits and the ranks gather them,
dropping the padding, so every rank ends with the same full logits (and samples the same token).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.layers.linear import linear
from engine.parallel.group import SINGLE, TpGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        block = -(-vocab_size // tp.size)
        self.start = tp.rank * block
        self.weight = nn.Parameter(torch.empty(block, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // tp.size), hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[..., : self.vocab_size]
