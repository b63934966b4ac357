"""The worker base (every Executor hook's default) and plain decoding, the worker built on it alone.

A speculative worker subclasses WorkerBase and overrides what its algorithm changes; the engine
never needs to know which one runs (engine/executor.py declares the protocol).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.core import PLAIN_DECODE, Batch, DecodePlan, ForwardMode, Req, StepOutput
from engine.executor import (
    HostCopy,
    build_input_ids,
    last_token_rows,
    sample_positions,
    sample_tokens,
    sampled_output,
    sampling_reqs,
    scatter_to_batch,
    seed_prebuilt_rows,
)
from engine.future_map import BatchRelay, DraftInput, FutureMap, RelayPayload
from engine.h2d import to_device
from engine.handoff import HandoffCodec, NoPayloadCodec
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler, plain_argmax_ok
from engine.spec_stats import SpecStats
from engine.step_graphs import StepGraphs


class WorkerBase:
    """The defaults of every Executor hook: the target alone, one token per decode step, nothing
    carried in a PD handoff but the first token. Subclasses implement `launch` and `collect`."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner, self.sampler = runner, sampler
        self._future_map: FutureMap | None = None

    def bind_future_map(self, future_map: FutureMap) -> None:
        self._future_map = future_map

    @property
    def future_map(self) -> FutureMap:
        if self._future_map is None:
            raise RuntimeError("no FutureMap bound: the scheduler binds one at start-up")
        return self._future_map

    def kv_tokens_per_decode(self) -> int:
        return 1

    def activate_step_by_batch(self, batch_size: int) -> int:
        return 0

    def plan_decode(self, batch_size: int, room: int) -> DecodePlan:
        return PLAIN_DECODE

    def supports_overlap(self) -> bool:
        return True

    def supports_mixed_batches(self) -> bool:
        return False

    def settles_grammar_in_launch(self) -> bool:
        """Only workers whose every matcher read follows `Batch.settle_grammar` say yes."""
        return False

    def capture_cuda_graphs(self) -> None:
        """Decode forward graphs for every captured batch size, and the prompt graphs (a no-op
        when graphs are off)."""
        self.runner.capture(ForwardMode.DECODE, 1)
        self.runner.capture_prompts(ForwardMode.EXTEND)
        self.runner.freeze_graphs()

    def on_admit(self, req: Req) -> None:
        self.sampler.on_admit(req)

    def adopt_prebuilt(self, reqs: list[Req], draft_input: DraftInput, relay: BatchRelay) -> None:
        seed_prebuilt_rows(reqs, draft_input, relay)

    def on_release(self, req: Req) -> None:
        req.spec_state = None

    def prefix_cache_shift(self) -> int:
        return 0

    def cacheable_tokens(self, req: Req) -> int:
        return req.seq_len  # the target's KV of every committed token

    def extra_kv_pools(self) -> list[KVPool]:
        return []

    def handoff_codec(self) -> HandoffCodec:
        return NoPayloadCodec()

    def spec_stats(self) -> SpecStats | None:
        return None

    def adaptive_snapshot(self) -> dict[str, Any] | None:
        return None

    @torch.inference_mode()
    def step(self, batch: Batch, relay: BatchRelay) -> StepOutput:
        return self.collect(self.launch(batch, relay))

    def launch(self, batch: Batch, relay: BatchRelay) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement launch")

    def collect(self, handle: Any) -> StepOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement collect")


@dataclass
class PlainPending:
    batch: Batch
    copy: HostCopy | None  # None when no request samples (non-final prefill chunks only)


class PlainExecutor(WorkerBase):
    """Target model only: prefill chunks and decode steps, one sampled token per request."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        super().__init__(runner, sampler)
        self.step_graphs: StepGraphs | None = None  # whole greedy decode steps (capture_cuda_graphs)

    def settles_grammar_in_launch(self) -> bool:
        return True  # masks are built after the forward is enqueued (launch)

    def supports_mixed_batches(self) -> bool:
        return True  # a decode step is one forward: its rows join a prompt chunk's

    def capture_cuda_graphs(self) -> None:
        """Decode forward graphs for every captured batch size, the mixed graphs (when the node
        mixes), and whole greedy decode steps (a no-op when graphs are off)."""
        self.runner.capture_mixed()  # before freezing, which the base's captures end with
        super().capture_cuda_graphs()
        graphs = self.runner.graphs
        if graphs is None:
            return
        fm, dev = self.future_map, self.runner.device
        self.step_graphs = StepGraphs(
            graphs.batch_sizes,
            capture=graphs.use_graphs,
            after_warmup=lambda: fm.invalidate(torch.zeros(1, dtype=torch.int64)),
        )
        for bs in sorted(graphs.batch_sizes, reverse=True):
            slots, prefix = (torch.zeros(bs, dtype=torch.int64, device=dev) for _ in range(2))
            body = (lambda sl, pr: lambda: greedy_decode_step(self.runner, fm, sl, pr))(slots, prefix)
            self.step_graphs.add(bs, {"slots": slots, "prefix": prefix}, body)

    @torch.inference_mode()
    def launch(self, batch: Batch, relay: BatchRelay) -> PlainPending:
        reqs, dev = batch.reqs, self.runner.device
        if batch.mode is ForwardMode.DECODE:
            tokens = self._graphed_decode(batch, relay)
            if tokens is not None:
                return PlainPending(batch, HostCopy({"tokens": tokens}))
        decode = batch.mode is ForwardMode.DECODE
        mode = ForwardMode.EXTEND if batch.mode is ForwardMode.MIXED else batch.mode
        slots = [r.slot for r in reqs]
        ctx = self.runner.make_context(mode, slots, batch.prefix_lens, batch.extend_lens, decode_rows=batch.decode_rows)
        ids = relay.resolve().bonus_tokens if decode else self._input_ids(batch, relay)
        hidden, _ = self.runner.forward(ids, ctx)
        if not any(batch.sample):
            return PlainPending(batch, None)
        rows = hidden if decode else hidden[last_token_rows(batch, dev)]
        sampling = sampling_reqs(batch)
        if any(r.grammar is not None for r in sampling):
            batch.settle_grammar()  # the forward is enqueued: the collect hides behind it
        logits = self.runner.logits(rows)
        if batch.mode is ForwardMode.MIXED and plain_argmax_ok(sampling):
            # greedy: the argmax on the device, as the whole-step decode graph takes it, rather than
            # sampling tensors built on the host for every decode row of the step
            out = {"tokens": logits.argmax(-1)}
        else:
            out = sample_tokens(self.sampler, logits, sampling, sample_positions(batch))
        relay.select(batch.sample).stash(RelayPayload(out["tokens"]))
        return PlainPending(batch, HostCopy(out))

    def _input_ids(self, batch: Batch, relay: BatchRelay) -> torch.Tensor:
        """A prompt batch's tokens, all on the host; a mixed batch's decode rows' come first, from
        the FutureMap (the batch in flight may still be sampling them)."""
        d = batch.decode_rows
        prompt = build_input_ids(batch, self.runner.device, first=d)
        if not d:
            return prompt
        decoding = relay.head(d).resolve().bonus_tokens
        return torch.cat((decoding, prompt))

    def _graphed_decode(self, batch: Batch, relay: BatchRelay) -> torch.Tensor | None:
        """The batch's new tokens through a whole-step graph, or None when it is not eligible."""
        graphs = self.step_graphs
        bs = graphs.padded(len(batch.reqs)) if graphs is not None else None
        if graphs is None or bs is None or not plain_argmax_ok(batch.reqs):
            return None
        entry = graphs.get(bs)
        assert entry is not None
        lens = to_device(batch.prefix_lens, self.runner.device)
        self.future_map.wait_published()  # PD seeding publishes from another stream
        (tokens,) = graphs.run(entry, len(batch.reqs), {"slots": relay.indices, "prefix": lens})
        return tokens.clone()

    def collect(self, pending: PlainPending) -> StepOutput:
        if pending.copy is None:
            return StepOutput(tokens=[[] for _ in pending.batch.reqs])
        sampled = sampled_output(pending.copy.wait())
        return scatter_to_batch(sampled, pending.batch.sample)


def greedy_decode_step(
    runner: ModelRunner, future_map: FutureMap, slots: torch.Tensor, prefix: torch.Tensor
) -> tuple[torch.Tensor]:
    """One plain decode step of greedy requests in fixed-shape device ops: last tokens from the
    FutureMap, forward, argmax, stash (padding rows: slot 0, kept at zero)."""
    ids = future_map.resolve(slots, wait=False).bonus_tokens
    ctx = runner.window_context(ForwardMode.DECODE, slots, prefix, 1)
    hidden, _ = runner.forward_direct(ids, ctx)
    tokens = runner.logits(hidden).argmax(-1)
    future_map.stash(slots, RelayPayload(torch.where(slots != 0, tokens, 0)))
    return (tokens,)


__all__ = ["PlainExecutor", "PlainPending", "WorkerBase", "greedy_decode_step"]
