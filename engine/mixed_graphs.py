"""Mixed batches in CUDA graphs: a plain decode step's rows and one prompt chunk, padded to buckets.

A mixed batch (ForwardMode.MIXED, run as an EXTEND forward with `ForwardContext.decode_rows`) has
d decode rows of one token each, then a prompt chunk of n tokens in one request. Its bucket is
(D decode rows, T chunk tokens), D and T the smallest held that fit, and its static layout is:

- tokens [0, D): the decode rows' (live ones first; the rest padding decode rows: slot 0,
  length 1, writing and reading page 0 as a padded row of a decode graph does);
- tokens [D, D + T): the chunk's n tokens, then the padded tokens, owned by a padding request
  after the chunk's (slot 0, as in engine/prompt_graphs.py): every computed row stays finite.

`qo_indptr` over the decode rows is constant (one token each), so one graph serves every d <= D
and n <= T. The live rows are gathered back out of the static output (`live_rows`).

Why: a chunk run beside a decode step reads the weights once for both. Eagerly such a forward
costs the host's ~400 launches again (engine/prompt_graphs.py), more than the decode step itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from engine.core import ForwardMode
from engine.forward_context import ForwardContext

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
CHUNK_TOKEN_BUCKETS = (64, 128, 256, 384, 512)
# chunk requests a mixed batch holds: the TPOT guard runs one prompt at a time
CHUNK_ROWS = 1


@dataclass(frozen=True)
class MixedBuckets:
    """The (decode rows, chunk tokens) shapes mixed graphs are captured at."""

    decode: tuple[int, ...]
    tokens: tuple[int, ...]

    @classmethod
    def up_to(cls, max_tokens: int, max_decode: int) -> MixedBuckets | None:
        """Buckets of chunks of at most `max_tokens` beside at most `max_decode` decode rows (the
        largest decode bucket is `max_decode` itself); None when `max_tokens` fits no bucket."""
        tokens = tuple(t for t in CHUNK_TOKEN_BUCKETS if t <= max_tokens)
        decode = tuple(sorted({d for d in DECODE_BUCKETS if d < max_decode} | {max_decode}))
        return cls(decode, tokens) if tokens and max_decode >= 1 else None

    def fit(self, decode_rows: int, chunk_tokens: int, chunk_rows: int) -> tuple[int, int] | None:
        """The smallest (decode rows, chunk tokens) bucket holding this batch, or None."""
        if chunk_rows != CHUNK_ROWS or decode_rows < 1 or chunk_tokens < 1:
            return None
        d = bisect.bisect_left(self.decode, decode_rows)
        t = bisect.bisect_left(self.tokens, chunk_tokens)
        if d == len(self.decode) or t == len(self.tokens):
            return None
        return self.decode[d], self.tokens[t]

    def shapes(self) -> list[tuple[int, int]]:
        """Every bucket, largest first (the memory pool and input arena are sized once)."""
        return sorted(((d, t) for d in self.decode for t in self.tokens), key=lambda s: s[0] + s[1], reverse=True)


def bucket_ceiling(tokens: int) -> int:
    """The smallest chunk bucket holding `tokens` (the largest bucket when none does)."""
    return next((t for t in CHUNK_TOKEN_BUCKETS if t >= tokens), CHUNK_TOKEN_BUCKETS[-1])


def mixed_unfit(input_ids: torch.Tensor, ctx: ForwardContext, model_inputs: dict[str, object]) -> str | None:
    """Why this forward is not a mixed batch a mixed graph can run (None when it is)."""
    d = ctx.decode_rows
    if ctx.mode is not ForwardMode.EXTEND or d < 1:
        return "not a mixed batch"
    if ctx.tree_mask is not None or model_inputs:
        return "mixed batch with a tree mask or model inputs"
    if tuple(input_ids.shape) != (ctx.num_tokens,) or len(ctx.extend_lens_cpu) != ctx.batch_size:
        return "token count mismatch"
    if any(n != 1 for n in ctx.extend_lens_cpu[:d]):
        return "a decode row with more than one token"
    return None


def static_mixed_context(
    decode: int, tokens: int, kv_pool: object, req_to_token: torch.Tensor, attn_backend: object, device: torch.device
) -> ForwardContext:
    """A bucket's static context, every row padding: `decode` decode rows, then CHUNK_ROWS + 1
    chunk rows over `tokens` tokens. The CPU lists are the bounds the backend sizes grids by."""
    rows = decode + CHUNK_ROWS + 1

    def zeros(size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int64, device=device)

    seq_lens, extend_lens, indptr = zeros(rows), zeros(rows), zeros(rows + 1)
    seq_lens[:decode] = 1
    extend_lens[:decode] = 1
    indptr[: decode + 1] = torch.arange(decode + 1, device=device)
    indptr[decode + 1 :] = decode
    width = int(req_to_token.shape[1])
    return ForwardContext(
        mode=ForwardMode.EXTEND,
        positions=zeros(decode + tokens),
        out_cache_loc=zeros(decode + tokens),
        req_slots=zeros(rows),
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        qo_indptr=indptr,
        req_to_token=req_to_token,
        kv_pool=kv_pool,  # type: ignore[arg-type]
        attn_backend=attn_backend,  # type: ignore[arg-type]
        seq_lens_cpu=[width] * rows,
        extend_lens_cpu=[1] * decode + [tokens] * (CHUNK_ROWS + 1),
        decode_rows=decode,
    )


def place_tokens(dst: torch.Tensor, src: torch.Tensor, live_decode: int, decode: int) -> None:
    """Per-token values of a live mixed batch into a bucket's layout (padding: zeros)."""
    n_chunk = src.shape[0] - live_decode
    dst[:live_decode].copy_(src[:live_decode])
    dst[live_decode:decode].zero_()
    dst[decode : decode + n_chunk].copy_(src[live_decode:])
    dst[decode + n_chunk :].zero_()


def load_mixed_context(static: ForwardContext, live: ForwardContext, padded_eager: bool) -> None:
    """Copy a live mixed batch into a bucket's static context."""
    d, big_d = live.decode_rows, static.decode_rows
    tokens = static.num_tokens - big_d
    n_chunk = live.num_tokens - d
    b_chunk = live.batch_size - d
    pad = tokens - n_chunk
    for dst, src, pad_decode, pad_chunk in (
        (static.req_slots, live.req_slots, 0, 0),
        (static.seq_lens, live.seq_lens, 1, pad),
        (static.extend_lens, live.extend_lens, 1, pad),
    ):
        dst[:d].copy_(src[:d])
        dst[d:big_d].fill_(pad_decode)
        dst[big_d : big_d + b_chunk].copy_(src[d:])
        dst[big_d + b_chunk : big_d + b_chunk + 1].fill_(pad_chunk)
        dst[big_d + b_chunk + 1 :].fill_(0)
    # decode rows' offsets are constant; the chunk's follow the bucket's decode tokens
    static.qo_indptr[big_d + 1 : big_d + b_chunk + 1].copy_(live.qo_indptr[d + 1 :] - d + big_d)
    static.qo_indptr[big_d + b_chunk + 1 :].fill_(big_d + tokens)
    place_tokens(static.positions, live.positions, d, big_d)
    place_tokens(static.out_cache_loc, live.out_cache_loc, d, big_d)
    if padded_eager:  # the eager backends read the live lengths from the host lists
        empty = [0] * (static.batch_size - big_d - b_chunk - 1)
        static.seq_lens_cpu = live.seq_lens_cpu[:d] + [1] * (big_d - d) + live.seq_lens_cpu[d:] + [pad] + empty
        static.extend_lens_cpu = live.extend_lens_cpu[:d] + [1] * (big_d - d) + live.extend_lens_cpu[d:] + [pad] + empty


def live_rows(live_decode: int, decode: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Rows of a bucket's output that hold the live batch's tokens, in the batch's order."""
    n_chunk = num_tokens - live_decode
    return torch.cat((torch.arange(live_decode, device=device), torch.arange(decode, decode + n_chunk, device=device)))
