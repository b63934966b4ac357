"""The Executor protocol (what runs a scheduled Batch and returns new tokens) and the helpers workers share.

The scheduler and the node facade see only the `Executor` protocol, so a speculative worker
(spec/) plugs in here without the engine knowing which algorithm it is; every hook the engine
asks of an executor is declared on the protocol, and engine/worker.py's WorkerBase holds the
defaults every worker starts from. A step is split in two: `launch` enqueues the device work and starts copying the
results to the host; `collect` waits for those copies and builds the StepOutput. The overlap
scheduler forms and launches batch N+1 between the two halves of batch N; the synchronous path is
`step = collect(launch(batch))`.

Nothing a launch needs may come from a device value the host has not seen: the next input token
of a decoding request is gathered on the device from the batch's FutureMap rows (`BatchRelay`),
which every sampling step stashes into.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.core import Batch, DecodePlan, Req, StepOutput
from engine.future_map import BatchRelay, DraftInput, FutureMap
from engine.h2d import to_device
from engine.handoff import HandoffCodec
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.spec_stats import SpecStats


class Executor(Protocol):
    """What the scheduler, the engine and the PD facade need from whoever runs the model."""

    def bind_future_map(self, future_map: FutureMap) -> None:
        """The scheduler's FutureMap (built by the algorithm), bound once at start-up."""

    @property
    def future_map(self) -> FutureMap:
        """The bound FutureMap."""

    def step(self, batch: Batch, relay: BatchRelay) -> StepOutput:
        """Run one forward (or one speculative round) and return the new tokens per request."""

    def launch(self, batch: Batch, relay: BatchRelay) -> Any:
        """Enqueue the step's device work; returns a handle for `collect` (no host sync).
        `relay` holds the batch's FutureMap rows; `relay.on_publish` fences the new lengths."""

    def collect(self, handle: Any) -> StepOutput:
        """Wait for a launched step's results and bring them to the host."""

    def supports_overlap(self) -> bool:
        """May the scheduler launch the next batch before collecting this one? False for
        executors that need the host to know the previous tokens (e.g. drafts from history)."""

    def supports_mixed_batches(self) -> bool:
        """May a plain decode step and a prompt chunk run as one MIXED batch (`Batch.mixed`)? Its
        decode rows' inputs come from the FutureMap, its prompt rows' from the host, and it samples
        like an EXTEND batch. Workers whose decode step is more than one forward say no."""

    def settles_grammar_in_launch(self) -> bool:
        """Does `launch` call `Batch.settle_grammar` before it reads any grammar matcher? Then an
        overlapping scheduler launches a constrained batch before collecting the one in flight;
        otherwise it collects first (one sync, the overlap given up while such requests run)."""

    def kv_tokens_per_decode(self) -> int:
        """The most KV slots any decode step may write beyond `seq_len` (1 plain; the widest
        verify window or draft scratch under speculation): admission headroom."""

    def activate_step_by_batch(self, batch_size: int) -> int:
        """SGLang's adaptive hook, called at the top of every decode iteration (by `plan_decode`):
        the draft step count a batch of this size runs with (0: plain decoding)."""

    def plan_decode(self, batch_size: int, room: int) -> DecodePlan:
        """How the next decode batch of `batch_size` requests runs, writing at most `room` KV slots
        beyond each request's length (the context room its tightest request has left, >= 1): the
        step count `activate_step_by_batch` chose, shrunk near the context limit down to plain
        decoding, with the worker's runtime state for it. The plan travels with the batch
        (`Batch.plan`): `launch` runs exactly what was planned."""

    def on_admit(self, req: Req) -> None:
        """A request got a KV slot (first time, after a retraction, or PD prebuilt adoption)."""

    def adopt_prebuilt(self, reqs: list[Req], draft_input: DraftInput, relay: BatchRelay) -> None:
        """PD decode: requests whose KV arrived from a prefill node join; seed their FutureMap
        rows (`relay`) from the algorithm's draft input, as their prefill's stash would have."""

    def on_release(self, req: Req) -> None:
        """A request gave its KV slot back (finished, aborted or retracted), after every
        in-flight forward that used it was collected."""

    def prefix_cache_shift(self) -> int:
        """How the prefix cache keys this algorithm's KV: 0 when every pool's KV at a position
        depends on the tokens up to it; 1 when a draft's KV at position i also reads token i + 1
        (EAGLE), so a cached page is reused only before the token it was computed with."""

    def cacheable_tokens(self, req: Req) -> int:
        """Leading positions of `req` whose KV is final in every pool this algorithm keeps (the
        prefix cache takes their whole pages when the request gives its slot back)."""

    def capture_cuda_graphs(self) -> None:
        """Capture every decode-loop forward's graphs at start-up (no-op when graphs are off),
        then freeze its runners: a shape not captured runs eagerly, never captured mid-serving."""

    def extra_kv_pools(self) -> list[KVPool]:
        """KV pools besides the target's that share its page ids (PD moves them too)."""

    def handoff_codec(self) -> HandoffCodec:
        """The algorithm's part of a PD handoff row (draft state carried prefill -> decode)."""

    def spec_stats(self) -> SpecStats | None:
        """Speculative counters, or None without speculation."""

    def adaptive_snapshot(self) -> dict[str, Any] | None:
        """Adaptive speculation's state, or None when steps are fixed: {"slots": [{"lower_bound",
        "upper_bound", "current_steps", "ema", "switches", ...}], "switches": total}."""


_EXECUTOR_HOOKS = tuple(n for n in vars(Executor) if not n.startswith("_"))


def check_executor(executor: Executor, algorithm: str) -> Executor:
    """Refuse a worker that lacks part of the protocol, naming what it lacks (checked on its
    class, so properties are not evaluated before the scheduler binds their state)."""
    missing = sorted(n for n in _EXECUTOR_HOOKS if not hasattr(type(executor), n))
    if missing:
        raise TypeError(
            f"{algorithm}: its worker {type(executor).__name__} does not implement the "
            f"Executor protocol (engine/executor.py): missing {missing}"
        )
    return executor


# ---------------------------------------------------------------- host copies


class HostCopy:
    """Device results on their way to the host: non_blocking copies into pinned memory, then an
    event. On CPU the tensors already are host tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._event: Any = None
        self._host = tensors
        dev = next((t.device for t in tensors.values()), torch.device("cpu"))
        if dev.type == "cuda":
            self._host = {
                k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for k, t in tensors.items()
            }
            self._event = torch.cuda.Event()
            self._event.record()
        elif dev.type != "cpu":  # other accelerators: a plain (synchronising) copy stays correct
            self._host = {k: t.cpu() for k, t in tensors.items()}

    def wait(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def unwaited(self) -> dict[str, torch.Tensor]:
        """The host tensors, which hold the results once `wait()` has returned."""
        return self._host


# ---------------------------------------------------------------- batch helpers


def build_input_ids(batch: Batch, device: torch.device, first: int = 0) -> torch.Tensor:
    """Extend tokens [prefix, prefix + n) of each request from the `first`; all known on the host
    (a request with a token still on the device is decoding, not extending)."""
    ids: list[int] = []
    for req, p, n in zip(batch.reqs[first:], batch.prefix_lens[first:], batch.extend_lens[first:]):
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


def seed_prebuilt_rows(reqs: list[Req], draft_input: DraftInput, relay: BatchRelay) -> torch.Tensor:
    """PD decode: publish the prebuilt requests' committed lengths and stash their draft input's
    rows, as their prefill's forward would have (the one way a prebuilt request is seeded);
    returns the rows' indices."""
    no_slot = [r.rid for r in reqs if r.slot <= 0]
    if no_slot:
        raise ValueError(f"requests {no_slot} have no KV slot to seed")
    if len(draft_input) != len(reqs):
        raise ValueError(f"draft input has {len(draft_input)} rows for {len(reqs)} prebuilt requests")
    relay.seed(to_device([r.seq_len for r in reqs], relay.indices.device), draft_input.relay_payload())
    return relay.indices


def sample_tokens(
    sampler: Sampler, logits: torch.Tensor, reqs: list[Req], positions: list[int]
) -> dict[str, torch.Tensor]:
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
        out.top_logprobs = [[list(zip(i, v))] for i, v in zip(host["top_ids"].tolist(), host["top_values"].tolist())]
    return out


def scatter_to_batch(sampled: StepOutput, mask: list[bool]) -> StepOutput:
    """Spread per-sampling-request results back to all batch rows (empty where nothing sampled)."""
    if all(mask):
        return sampled
    it = iter(range(len(sampled.tokens)))
    idx = [next(it) if m else -1 for m in mask]
    pick = lambda xs: [xs[i] if i >= 0 else [] for i in idx]  # noqa: E731
    return StepOutput(
        tokens=pick(sampled.tokens),
        logprobs=pick(sampled.logprobs) if sampled.logprobs else None,
        top_logprobs=pick(sampled.top_logprobs) if sampled.top_logprobs else None,
    )


def maybe_enable_cuda_graphs(
    runner: ModelRunner, max_bs: int, padded_eager: bool = False, prompt_tokens: int = 0, mixed_tokens: int = 0
) -> None:
    """`EngineConfig.cuda_graph_max_bs` > 0: capture this runner's fixed-shape forwards on CUDA,
    its prompt batches of up to `prompt_tokens` tokens and its mixed batches' chunks of up to
    `mixed_tokens`; elsewhere, with `padded_eager`, run them through the same padded static
    buffers uncaptured (how the graph path is tested on CPU)."""
    if max_bs <= 0:
        return
    if runner.device.type == "cuda" or padded_eager:
        capture = runner.device.type == "cuda"
        runner.enable_cuda_graphs(max_bs, capture=capture, prompt_tokens=prompt_tokens, mixed_chunk_tokens=mixed_tokens)
