"""Executors run a scheduled Batch and return new tokens; the plain one samples one token per step.

The scheduler only sees the `Executor` protocol, so a speculative worker (spec/) plugs in here
without the engine knowing which algorithm it is.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.core import Batch, ForwardMode, Req, StepOutput
from engine.model_runner import ModelRunner
from engine.sampler import Sampler


class Executor(Protocol):
    """What the scheduler needs from whoever runs the model."""

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput:
        """Run one forward (or one speculative round) and return the new tokens per request."""

    def kv_tokens_per_decode(self) -> int:
        """KV slots one decode step may write beyond `seq_len` (1 plain; drafts under speculation)."""

    def on_admit(self, req: Req) -> None:
        """A request got a KV slot (first time or after a retraction)."""

    def on_release(self, req: Req) -> None:
        """A request gave its KV slot back (finished, aborted or retracted)."""


def build_input_ids(batch: Batch, device: torch.device) -> torch.Tensor:
    ids: list[int] = []
    for req, n in zip(batch.reqs, batch.extend_lens):
        ids.extend(req.tokens(req.seq_len, req.seq_len + n))
    return torch.tensor(ids, dtype=torch.int64, device=device)


def last_token_rows(ctx_qo_indptr: torch.Tensor, sample_mask: list[bool]) -> torch.Tensor:
    """Packed row of each sampling request's last query token."""
    rows = ctx_qo_indptr[1:] - 1
    if all(sample_mask):
        return rows
    keep = torch.tensor(sample_mask, device=rows.device)
    return rows[keep]


def sample_output(sampler: Sampler, logits: torch.Tensor, reqs: list[Req]) -> StepOutput:
    """Sample one token per request and move everything the scheduler needs to the CPU at once."""
    sb = sampler.prepare(reqs)
    want_lp = any(r.params.logprobs for r in reqs)
    n_top = max((r.params.top_logprobs for r in reqs), default=0)
    res = sampler.sample(logits, sb, want_logprobs=want_lp, top_logprobs=n_top)
    sampler.record(reqs, res.tokens)
    tokens = res.tokens.tolist()
    out = StepOutput(tokens=[[t] for t in tokens])
    if want_lp and res.logprobs is not None:
        out.logprobs = [[v] for v in res.logprobs.tolist()]
        if n_top and res.top_ids is not None and res.top_values is not None:
            out.top_logprobs = [[list(zip(i, v))] for i, v in
                                zip(res.top_ids.tolist(), res.top_values.tolist())]
    return out


class PlainExecutor:
    """Target model only: prefill chunks and decode steps, one sampled token per request."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner, self.sampler = runner, sampler

    def kv_tokens_per_decode(self) -> int:
        return 1

    def on_admit(self, req: Req) -> None:
        self.sampler.on_admit(req)

    def on_release(self, req: Req) -> None:
        pass

    def step(self, batch: Batch) -> StepOutput:
        reqs = batch.reqs
        ctx = self.runner.make_context(batch.mode, [r.slot for r in reqs], [r.seq_len for r in reqs],
                                       batch.extend_lens)
        hidden, _ = self.runner.forward(build_input_ids(batch, self.runner.device), ctx)
        sampling = [r for r, s in zip(reqs, batch.sample) if s]
        if not sampling:
            return StepOutput(tokens=[[] for _ in reqs])
        rows = hidden if batch.mode is ForwardMode.DECODE else hidden[
            last_token_rows(ctx.qo_indptr, batch.sample)]
        sampled = sample_output(self.sampler, self.runner.logits(rows), sampling)
        return scatter_to_batch(sampled, batch.sample)


def scatter_to_batch(sampled: StepOutput, mask: list[bool]) -> StepOutput:
    """Spread per-sampling-request results back to all batch rows (empty where nothing sampled)."""
    if all(mask):
        return sampled
    it = iter(range(len(sampled.tokens)))
    idx = [next(it) if m else -1 for m in mask]
    pick = (lambda xs: [xs[i] if i >= 0 else [] for i in idx])  # noqa: E731
    return StepOutput(tokens=pick(sampled.tokens),
                      logprobs=pick(sampled.logprobs) if sampled.logprobs else None,
                      top_logprobs=pick(sampled.top_logprobs) if sampled.top_logprobs else None)
