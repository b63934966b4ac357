"""Executors run a scheduled Batch and return new tokens; the plain one samples one token per step.

The scheduler only sees the `Executor` protocol, so a speculative worker (spec/) plugs in here
without the engine knowing which algorithm it is. A step is split in two: `launch` enqueues the
device work and starts copying the results to the host; `collect` waits for those copies and
builds the StepOutput. The overlap scheduler forms and launches batch N+1 between the two halves
of batch N; the synchronous path is `step = collect(launch(batch))`.

Nothing a launch needs may come from a device value the host has not seen: the next input token
of a decoding request is gathered on the device from a per-slot token table that every sampling
step scatters into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.core import Batch, ForwardMode, Req, StepOutput
from engine.h2d import to_device
from engine.model_runner import ModelRunner
from engine.sampler import Sampler


class Executor(Protocol):
    """What the scheduler needs from whoever runs the model."""

    def step(self, batch: Batch) -> StepOutput:
        """Run one forward (or one speculative round) and return the new tokens per request."""

    def launch(self, batch: Batch) -> Any:
        """Enqueue the step's device work; returns a handle for `collect` (no host sync)."""

    def collect(self, handle: Any) -> StepOutput:
        """Wait for a launched step's results and bring them to the host."""

    def supports_overlap(self) -> bool:
        """May the scheduler launch the next batch before collecting this one? False for
        executors that need the host to know the previous tokens (e.g. drafts from history)."""

    def kv_tokens_per_decode(self) -> int:
        """KV slots one decode step may write beyond `seq_len` (1 plain; drafts under speculation)."""

    def on_admit(self, req: Req) -> None:
        """A request got a KV slot (first time, after a retraction, or PD PREBUILT adoption)."""

    def on_release(self, req: Req) -> None:
        """A request gave its KV slot back (finished, aborted or retracted), after every
        in-flight forward that used it was collected."""


# ---------------------------------------------------------------- host copies


class HostCopy:
    """Device results on their way to the host: non_blocking copies into pinned memory, then an
    event. On CPU the tensors already are host tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._event: Any = None
        self._host = tensors
        dev = next((t.device for t in tensors.values()), torch.device("cpu"))
        if dev.type == "cuda":
            self._host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for k, t in tensors.items()}
            self._event = torch.cuda.Event()
            self._event.record()
        elif dev.type != "cpu":  # other accelerators: a plain (synchronising) copy stays correct
            self._host = {k: t.cpu() for k, t in tensors.items()}

    def wait(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


# ---------------------------------------------------------------- batch helpers


def build_input_ids(batch: Batch, device: torch.device) -> torch.Tensor:
    """Extend tokens [prefix, prefix + n) of each request; all known on the host (a request with
    a token still on the device is decoding, not extending)."""
    ids: list[int] = []
    for req, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        ids += req.tokens(p, p + n)
    return to_device(ids, device)


def last_token_rows(batch: Batch, device: torch.device) -> torch.Tensor:
    """Packed row of each sampling request's last query token (from host lengths: no sync)."""
    rows, end = [], 0
    for n, s in zip(batch.extend_lens, batch.sample):
        end += n
        if s:
            rows.append(end - 1)
    return to_device(rows, device)


def sample_positions(batch: Batch) -> list[int]:
    """Index of the token each sampling request samples: the end of its window."""
    return [p + n for p, n, s in zip(batch.prefix_lens, batch.extend_lens, batch.sample) if s]


def sampling_reqs(batch: Batch) -> list[Req]:
    return [r for r, s in zip(batch.reqs, batch.sample) if s]


# ---------------------------------------------------------------- the plain executor


@dataclass
class PlainPending:
    batch: Batch
    copy: HostCopy | None  # None when no request samples (non-final prefill chunks only)


class PlainExecutor:
    """Target model only: prefill chunks and decode steps, one sampled token per request."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner, self.sampler = runner, sampler
        # last sampled token per request slot (row 0: padding): the next decode's input
        self.tokens = torch.zeros(runner.kv.req_to_token.shape[0], dtype=torch.int64, device=runner.device)

    def kv_tokens_per_decode(self) -> int:
        return 1

    def supports_overlap(self) -> bool:
        return True

    def capture_cuda_graphs(self) -> None:
        """Decode graphs for every captured batch size (a no-op when graphs are off)."""
        self.runner.capture(ForwardMode.DECODE, 1)

    def on_admit(self, req: Req) -> None:
        self.sampler.on_admit(req)
        if req.output_ids:  # PD PREBUILT: the first token came from the prefill node
            self.tokens[req.slot] = req.output_ids[-1]

    def on_release(self, req: Req) -> None:
        pass

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput:
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: Batch) -> PlainPending:
        reqs, dev = batch.reqs, self.runner.device
        ctx = self.runner.make_context(batch.mode, [r.slot for r in reqs], batch.prefix_lens,
                                       batch.extend_lens)
        decode = batch.mode is ForwardMode.DECODE
        ids = self.tokens[ctx.req_slots] if decode else build_input_ids(batch, dev)
        hidden, _ = self.runner.forward(ids, ctx)
        if not any(batch.sample):
            return PlainPending(batch, None)
        rows = hidden if decode else hidden[last_token_rows(batch, dev)]
        sampling = sampling_reqs(batch)
        out = sample_tokens(self.sampler, self.runner.logits(rows), sampling, sample_positions(batch))
        self.tokens[to_device([r.slot for r in sampling], dev)] = out["tokens"]
        return PlainPending(batch, HostCopy(out))

    def collect(self, pending: PlainPending) -> StepOutput:
        if pending.copy is None:
            return StepOutput(tokens=[[] for _ in pending.batch.reqs])
        sampled = sampled_output(pending.copy.wait())
        return scatter_to_batch(sampled, pending.batch.sample)


def sample_tokens(sampler: Sampler, logits: torch.Tensor, reqs: list[Req],
                  positions: list[int]) -> dict[str, torch.Tensor]:
    """Sample one token per request on the device; returns what the host will need."""
    sb = sampler.prepare(reqs, positions=positions)
    want_lp = any(r.params.logprobs for r in reqs)
    n_top = max((r.params.top_logprobs for r in reqs), default=0)
    res = sampler.sample(logits, sb, want_logprobs=want_lp, top_logprobs=n_top)
    sampler.record(reqs, res.tokens)
    out = {"tokens": res.tokens}
    if want_lp and res.logprobs is not None:
        out["logprobs"] = res.logprobs
        if n_top and res.top_ids is not None and res.top_values is not None:
            out["top_ids"], out["top_values"] = res.top_ids, res.top_values
    return out


def sampled_output(host: dict[str, torch.Tensor]) -> StepOutput:
    out = StepOutput(tokens=[[t] for t in host["tokens"].tolist()])
    if "logprobs" in host:
        out.logprobs = [[v] for v in host["logprobs"].tolist()]
    if "top_ids" in host:
        out.top_logprobs = [[list(zip(i, v))] for i, v in
                            zip(host["top_ids"].tolist(), host["top_values"].tolist())]
    return out


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


def maybe_enable_cuda_graphs(runner: ModelRunner, max_bs: int) -> None:
    """`EngineConfig.cuda_graph_max_bs` > 0 on CUDA: capture this runner's fixed-shape forwards."""
    if max_bs > 0 and runner.device.type == "cuda":
        runner.enable_cuda_graphs(max_bs)
