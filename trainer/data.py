"""Token streams from documents, random training windows and fixed held-out windows."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from tokenizers import Tokenizer


def encode_stream(tok: Tokenizer, texts: Sequence[str], eos_id: int) -> torch.Tensor:
    """All documents as one packed stream: <bos> doc <eos> <bos> doc <eos> ... (int64)."""
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts)):  # the post-processor adds the BOS
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` windows of `length` tokens at random offsets (packed: they cross document ends)."""
    if stream.numel() <= length:
        raise ValueError(f"corpus has {stream.numel()} tokens, fewer than one window of {length + 1}")
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def heldout_windows(
    stream: torch.Tensor, length: int, batch: int, max_windows: int | None = None
) -> Iterator[torch.Tensor]:
    """Consecutive non-overlapping windows in batches; a stream shorter than one window is one
    short window, so tiny test splits still evaluate."""
    n = max(1, (stream.numel() - 1) // length) if stream.numel() > length else 1
    if max_windows is not None:
        n = min(n, max_windows)
    width = min(length, stream.numel())
    wins = [stream[i * length : i * length + width] for i in range(n)]
    for i in range(0, n, batch):
        yield torch.stack(wins[i : i + batch])
