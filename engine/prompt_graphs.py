"""Ragged prompt forwards in CUDA graphs: a prompt batch padded to a token bucket and a row bucket.

A prompt batch (EXTEND, and the EAGLE draft's DRAFT_EXTEND over the same tokens) has requests of
any lengths, so the fixed-width graphs of engine/cuda_graph.py do not fit it. Here its n tokens
are packed at the front of a bucket of `tokens` slots and its r requests fill the first r of
`rows` + 1 rows. Row r is a padding request that owns the padded tokens [n, tokens): it reads and
writes only slot 0 (row 0 of the request table, page 0, both reserved for padding), so every row
the model computes is finite and page 0 never holds garbage that a masked key could read. Rows
after it hold no tokens (extend and sequence length 0) and the attention kernels skip them.
Kernel grids are sized by the bucket (every extend length is at most `tokens`), so one graph
serves every split of its bucket.

Why: eagerly a short prompt costs ~400 host launches, about 19 ms of wall time on an H100 for
6 ms of kernels (bench/results/profile_prompt_h100.json). Long prompts are launch-bound too where
the host is slow or busy: on an H200 host a 1,024-token prompt took 44 ms eagerly and 25 ms from a
graph (bench/results/profile_prompt_h200.json), and a loaded prefill node's 1,024-token batches
launched in 29-37 ms eagerly, 2.3 ms from graphs (bench/RESULTS.md, goodput). So buckets go on to
2,048 tokens, a chunked prefill's whole budget, by default (`--cuda-graph-prompt-tokens`; every 256
tokens past 512: a padded token costs what a real one does). Below 512 they are finer where a
bucket's step cost jumps: on an H200 a chunk over 2,000 cached tokens (the 8B shape, forward and
logits, graphed) took 6.9 / 7.2 / 8.0 / 8.9 / 10.7 / 11.9 ms at 128 / 160 / 192 / 256 / 320 / 384
tokens, so a follow-up turn of ~170 new tokens saves about 1 ms at 192 rather than 256. No 448:
cuBLAS ran that shape at 17.0 ms, slower than 512's 14.7 (bench/gpu/prefill_breakdown.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from engine.core import ForwardMode
from engine.forward_context import ForwardContext

PROMPT_MODES = (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)
TOKEN_BUCKETS = (32, 64, 128, 160, 192, 256, 320, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)
ROW_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class PromptBuckets:
    """The (tokens, rows) shapes prompt graphs are captured at."""

    tokens: tuple[int, ...]
    rows: tuple[int, ...]

    @classmethod
    def up_to(cls, max_tokens: int, max_rows: int) -> PromptBuckets | None:
        """Buckets of at most `max_tokens` tokens and `max_rows` requests (None: too small for any)."""
        tokens = tuple(t for t in TOKEN_BUCKETS if t <= max_tokens)
        rows = tuple(r for r in ROW_BUCKETS if r <= max_rows)
        return cls(tokens, rows) if tokens and rows else None

    def fit(self, num_tokens: int, batch_size: int) -> tuple[int, int] | None:
        """The smallest (tokens, rows) bucket holding this batch, or None."""
        t = bisect.bisect_left(self.tokens, num_tokens)
        r = bisect.bisect_left(self.rows, batch_size)
        if t == len(self.tokens) or r == len(self.rows) or num_tokens < 1:
            return None
        return self.tokens[t], self.rows[r]

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket, largest first (the memory pool and input arena are sized once)."""
        return sorted(((t, r) for t in self.tokens for r in self.rows), reverse=True)


def prompt_unfit(input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, object]) -> str | None:
    """Why this forward cannot run in a prompt graph, from CPU-side facts (None when it can)."""
    if ctx.mode not in PROMPT_MODES:
        return f"mode {ctx.mode.name}"
    if ctx.tree_mask is not None:
        return "tree mask in a prompt forward"
    n = ctx.num_tokens
    if tuple(input_ids.shape) != (n,) or len(ctx.extend_lens_cpu) != ctx.batch_size:
        return "token count mismatch"
    for v in model_inputs.values():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n:
            return "model input is not per-token"
    return None


def static_prompt_context(
    mode: ForwardMode,
    tokens: int,
    rows: int,
    aux_hidden_layers: tuple[int, ...],
    kv_pool: object,
    req_to_token: torch.Tensor,
    attn_backend: object,
    device: torch.device,
) -> ForwardContext:
    """A bucket's static context (`rows` + 1 rows), every row padding. The CPU lists are the
    bounds the backend sizes its grids by: every extend length is at most `tokens`, every
    sequence fits the table."""

    def zeros(size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int64, device=device)

    return ForwardContext(
        mode=mode,
        positions=zeros(tokens),
        out_cache_loc=zeros(tokens),
        req_slots=zeros(rows + 1),
        seq_lens=zeros(rows + 1),
        extend_lens=zeros(rows + 1),
        qo_indptr=zeros(rows + 2),
        req_to_token=req_to_token,
        kv_pool=kv_pool,  # type: ignore[arg-type]
        attn_backend=attn_backend,  # type: ignore[arg-type]
        seq_lens_cpu=[int(req_to_token.shape[1])] * (rows + 1),
        extend_lens_cpu=[tokens] * (rows + 1),
        aux_hidden_layers=aux_hidden_layers,
    )


def load_prompt_context(static: ForwardContext, live: ForwardContext, padded_eager: bool) -> None:
    """Copy a live prompt batch into a bucket's static context; the row after the live ones owns
    the padded tokens, the rows after that hold none."""
    n, b, tokens = live.num_tokens, live.batch_size, static.num_tokens
    pad = tokens - n
    for dst, src, pad_row, rest in (
        (static.req_slots, live.req_slots, 0, 0),
        (static.seq_lens, live.seq_lens, pad, 0),
        (static.extend_lens, live.extend_lens, pad, 0),
    ):
        dst[:b].copy_(src)
        dst[b : b + 1].fill_(pad_row)
        dst[b + 1 :].fill_(rest)
    static.qo_indptr[: b + 1].copy_(live.qo_indptr)
    static.qo_indptr[b + 1 :].fill_(tokens)
    for dst, src in ((static.positions, live.positions), (static.out_cache_loc, live.out_cache_loc)):
        dst[:n].copy_(src)
        dst[n:].fill_(0)
    if padded_eager:  # the eager backends read the live lengths from the host lists
        empty = [0] * (static.batch_size - b - 1)
        static.seq_lens_cpu = list(live.seq_lens_cpu) + [pad] + empty
        static.extend_lens_cpu = list(live.extend_lens_cpu) + [pad] + empty
