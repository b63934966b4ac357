"""The in-process Engine: load a model, batch prompts continuously, stream tokens and text."""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ContextManager, Iterator, Sequence

import torch

from engine.algorithm import EngineAlgorithm, EngineParts, PlainDecoding
from engine.build import build_rank
from engine.config import EngineConfig, check_device, mixed_chunk_sizes, mixed_chunk_tokens, parse_dtype
from engine.core import FinishReason, InvalidRequest, Req, SamplingParams, as_token_list
from engine.executor import Executor
from engine.grammar.base import CompiledGrammar
from engine.grammar.compiler import GrammarCompiler, make_backend, new_matcher
from engine.parallel.ranks import TpRanks
from engine.scheduler import BatchPolicy, PolicyConfig, RequestUpdate, Scheduler, SchedulerConfig
from engine.scheduler.rates import NodeRates
from engine.scheduler.tpot_guard import TpotGuard
from engine.scheduler.updates import SchedulerIO
from common.detokenize import TextAssembler
from common.sampling import Constraint
from common.tokenizer import Tokenizer


@dataclass
class GenerationOutput:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    finish_reason: FinishReason | None
    finish_detail: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    accepted_drafts: list[int] = field(default_factory=list)


@dataclass
class StreamDelta:
    rid: str
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    accepted_drafts: int | None = None


class _LocalIO:
    """In-process inbox/outbox for the scheduler (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[Req] = []
        self._aborts: list[str] = []
        self._wake = threading.Event()
        self.outbox: deque[RequestUpdate] = deque()

    def submit(self, req: Req) -> None:
        with self._lock:
            self._new.append(req)
        self._wake.set()

    def abort(self, rid: str) -> None:
        with self._lock:
            self._aborts.append(rid)
        self._wake.set()

    def poll(self) -> tuple[list[Req], list[str]]:
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        return new, aborts

    def publish(self, updates: list[RequestUpdate]) -> None:
        self.outbox.extend(updates)

    def wait_for_work(self, timeout: float) -> None:
        self._wake.wait(timeout)
        self._wake.clear()


def bind_thread_to_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device. Triton launches, new streams and
    graph captures go to the current device, not to their tensors': a node on cuda:1 that skipped
    this would run its kernels on GPU 0, reading GPU 1's memory over the peer link. A bare "cuda"
    means the current device already."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)


def on_device(device: torch.device) -> ContextManager[object]:
    """`device` as the calling thread's current CUDA device for the duration, the caller's own
    restored after: an engine built or stepped from a thread (a test, a script holding engines on
    two GPUs) launches its kernels on its GPU and leaves the thread as it found it. A no-op off
    CUDA, for a bare "cuda", and when the thread already is there (the hot path: one query)."""
    if device.type != "cuda" or device.index is None or torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


class Engine:
    """Generate for a batch of prompts (text or token ids), all at once or streaming."""

    def __init__(
        self, config: EngineConfig, algorithm: EngineAlgorithm | None = None, io: SchedulerIO | None = None
    ) -> None:
        started = time.perf_counter()
        self.config = config
        self.device = torch.device(config.device)
        with on_device(self.device):
            self._build(config, algorithm, io)
        self.tokenizer = _maybe_tokenizer(Path(config.model))
        self.grammars = self._grammar_compiler() if self.tokenizer is not None else None
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._texts: dict[str, TextAssembler] = {}
        self.load_seconds = time.perf_counter() - started  # weights, KV pool, graphs (node metrics)

    def _build(self, config: EngineConfig, algorithm: EngineAlgorithm | None, io: SchedulerIO | None) -> None:
        """Weights, KV pools, the algorithm's worker (every rank's, under tensor parallelism), the
        scheduler and the start-up graphs."""
        self.algorithm: EngineAlgorithm = algorithm or PlainDecoding()
        self.ranks = TpRanks.start(config, self.algorithm, self.device)
        rank = build_rank(config, self.algorithm, self.device, self.ranks.group)
        self.parts, self.max_context_len = rank.parts, rank.max_context_len
        self.model_config, self.kv, self.dtype = self.parts.model_config, self.parts.kv, self.parts.dtype
        self.executor: Executor = self.ranks.lead(rank.executor, self.kv)
        if config.radix_cache:
            self.kv.enable_prefix_cache(self.executor.prefix_cache_shift())
        self.rates = NodeRates()
        guard = None
        if config.tpot_guard_ms:
            guard = TpotGuard(config.tpot_guard_ms / 1000, self.rates, config.chunked_prefill_size)
        policy = BatchPolicy(
            PolicyConfig(
                config.max_running,
                config.chunked_prefill_size,
                max_context_len=self.max_context_len,
                mixed_chunk_tokens=mixed_chunk_tokens(config),
                mixed_chunk_sizes=mixed_chunk_sizes(config),
            ),
            self.kv,
            self.executor,
            guard,
        )
        self.io: SchedulerIO = io or _LocalIO()
        stops = SchedulerConfig(
            self.model_config.eos_token_ids, self.max_context_len, config.overlap, config.future_map_debug
        )
        self.scheduler = Scheduler(policy, self.executor, self.io, stops, self.algorithm, self.rates)
        if config.cuda_graph_max_bs > 0:  # after the scheduler bound the FutureMap graphs read
            self.executor.capture_cuda_graphs()  # at start-up, so first requests do not pay for captures

    @property
    def fatal(self) -> str | None:
        """Why this engine can never step again (a tensor-parallel rank died or hung), or None."""
        return self.ranks.failed

    def close(self) -> None:
        """Stop the follower ranks (no-op on one GPU)."""
        self.ranks.stop()

    def _grammar_compiler(self) -> GrammarCompiler:
        mc = self.model_config
        return GrammarCompiler(
            partial(make_backend, self.config.grammar_backend, self.config.model, mc.vocab_size, mc.eos_token_ids)
        )

    def compile_grammar(self, constraint: Constraint) -> Future[CompiledGrammar]:
        """The constraint's grammar, compiled on the grammar worker (or from its cache); the
        Future raises InvalidRequest naming what is wrong with a bad grammar."""
        if self.grammars is None:
            raise InvalidRequest("constrained output needs a tokenizer; this model directory has none")
        return self.grammars.submit(constraint)

    # ---- requests ----
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, rid: str | None = None
    ) -> str:
        """Queue one prompt; returns its request id. Bad input raises InvalidRequest."""
        return self._submit(prompt, params, rid).rid

    def _submit(self, prompt: str | Sequence[int], params: SamplingParams | None, rid: str | None = None) -> Req:
        params = params or SamplingParams()
        req = self.make_request(self._prompt_ids(prompt), params, rid)
        if params.constraint is not None:  # the in-process API waits for its compile here
            req.grammar = new_matcher(self.compile_grammar(params.constraint))
        if self.tokenizer is not None:
            self._texts[req.rid] = TextAssembler(
                self.tokenizer, params.stop, req.prompt_ids, params.min_new_tokens, params.skip_special_tokens
            )
        self.io.submit(req)
        return req

    def make_request(self, ids: list[int], params: SamplingParams, rid: str | None = None) -> Req:
        """Validate token ids against this model and build a Req (servers submit it themselves)."""
        if any(t < 0 or t >= self.model_config.vocab_size for t in ids):
            raise InvalidRequest(f"token id out of range (vocab size {self.model_config.vocab_size})")
        if not ids:
            raise InvalidRequest("prompt is empty")
        if len(ids) + 1 > self.max_context_len:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the context length is {self.max_context_len}")
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model directory has none")
        if params.constraint is not None and self.grammars is None:
            raise InvalidRequest("constrained output needs a tokenizer; this model directory has none")
        rid = rid or f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Req(rid, list(ids), params, sampling_seed=seed)

    def abort(self, rid: str) -> None:
        self.io.abort(rid)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)
        return as_token_list(prompt)

    # ---- driving the scheduler in the caller's thread ----
    def step(self) -> list[StreamDelta]:
        with on_device(self.device):
            self.scheduler.step()
        deltas = []
        while self.io.outbox:
            deltas.append(self._to_delta(self.io.outbox.popleft()))
        return deltas

    def _to_delta(self, upd: RequestUpdate) -> StreamDelta:
        text_state = self._texts.get(upd.rid)
        text = None
        reason = upd.finish_reason
        if text_state is not None:
            text, hit_stop = text_state.feed(upd.tokens, final=upd.finished)
            if hit_stop and not upd.finished:
                self.abort(upd.rid)  # the scheduler frees it next step; the client sees STOP now
                reason = FinishReason.STOP
                text += text_state.close()
            if upd.finished or hit_stop:
                self._texts.pop(upd.rid, None)
        finished = upd.finished or reason is FinishReason.STOP
        return StreamDelta(
            upd.rid,
            upd.tokens,
            text,
            finished,
            reason,
            upd.finish_detail,
            upd.logprobs,
            upd.top_logprobs,
            upd.accepted_drafts,
        )

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield each new piece of one request until it finishes (other requests keep running)."""
        rid = self.add_request(prompt, params)
        while True:
            for delta in self.step():
                if delta.rid == rid:
                    yield delta
                    if delta.finished:
                        return

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
        """Run all prompts as one continuous batch and return when every one has finished."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequest("params must be one SamplingParams or one per prompt")
        reqs = [self._submit(p, sp) for p, sp in zip(prompts, plist)]
        rids = [r.rid for r in reqs]
        outs = {
            r.rid: GenerationOutput(r.rid, list(r.prompt_ids), [], "" if r.rid in self._texts else None, None)
            for r in reqs
        }
        pending = set(rids)
        while pending:
            for d in self.step():
                if d.rid not in pending:
                    continue
                o = outs[d.rid]
                o.output_ids.extend(d.token_ids)
                o.logprobs.extend(d.logprobs)
                o.top_logprobs.extend(d.top_logprobs)
                if d.accepted_drafts is not None:
                    o.accepted_drafts.append(d.accepted_drafts)
                if d.text is not None:
                    o.text = (o.text or "") + d.text
                if d.finished:
                    o.finish_reason, o.finish_detail = d.finish_reason, d.finish_detail
                    pending.discard(d.rid)
        if not self.scheduler.policy.has_work:
            # overlap: the last batch in flight holds the finished requests' pages until collected
            self.step()
        return [outs[r] for r in rids]

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_work


def _maybe_tokenizer(model_dir: Path) -> Tokenizer | None:
    return Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None


__all__ = ["Engine", "EngineConfig", "EngineParts", "GenerationOutput", "StreamDelta", "check_device", "parse_dtype"]
