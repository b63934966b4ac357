"""Prompt-path warm-up at node start: first-touch kernel compiles paid before the first request,
and the prompt and mixed-chunk rates measured on warm kernels.

A GPU node captures its decode graphs at start-up, but its prompt path (extend attention of each
length class, a prompt over a cached prefix, the draft's prefill) compiles on first use: seconds
that the first real prompts would pay, and that the node's measured prompt rate (which the router
and the TPOT guard read) would take as the node's speed. So before it serves, the node runs a few
synthetic prompts through its own scheduler: one per length class, then a follow-up over a cached
prefix (the compile pass); then it forgets what the compile pass measured and times a few prompts
of a whole chunk and a few small ones (the measure pass: the prompt rate, and a batch's fixed
part). A node whose prompt chunks ride inside its decode steps (a decode node under a TPOT guard)
also runs prompts beside a decoding request, in both passes: its mixed steps' first touches are
paid, and the chunk's marginal rate the guard and the router price its own prompts by is measured
before its first real prompt. Unmeasured, the first few live mixed steps set it; on two H100s one
such reading (1,201 tokens/s against 54-66K profiled) priced every local prompt at seconds. Their
KV returns to the pool, the prefix cache is emptied, and the counters the node exports start from
zero.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass

from common.sampling import SamplingParams
from engine.engine import Engine
from engine.loop import EngineLoop
from engine.scheduler.updates import RequestUpdate

log = logging.getLogger(__name__)

# Prompt lengths of the compile pass, up to the node's chunk: Triton specialises integer arguments
# on divisibility by 16, and the kernels' block shapes on length, so both kinds of each size.
COMPILE_LENGTHS = (5, 16, 37, 64, 200, 256, 700, 1024)
MEASURE_PROMPTS = 3  # whole-chunk prompts the rate is measured on (the rate is their median)
OVERHEAD_PROMPTS = 3  # and small ones their fixed part (engine/scheduler/rates.py) is measured on
OVERHEAD_TOKENS = 32
FOLLOW_UP_TOKENS = 50  # new tokens after the cached prefix (a follow-up turn)
MIXED_PROMPTS = 2  # prompts of a whole chunk run beside one decoding request (a mixing node)
MIXED_DECODE_TOKENS = 128  # that request's output: it keeps decoding while they run
POLL_S = 0.1  # how often a wait looks whether the engine still runs


@dataclass(frozen=True)
class WarmupReport:
    prompts: int
    seconds: float
    prefill_tokens_per_s: float
    prompt_overhead_s: float
    mixed_tokens_per_s: float  # a prompt chunk's marginal rate inside a decode step (0: the node does not mix)


def compile_lengths(max_chunk: int, max_prompt: int) -> list[int]:
    """The compile pass's prompt lengths: every class up to the chunk, the chunk itself, and a
    prompt one odd piece longer (its second chunk runs over the first's KV)."""
    lengths = [n for n in COMPILE_LENGTHS if n < max_chunk] + [max_chunk, max_chunk + 37]
    return sorted({min(n, max_prompt) for n in lengths if n >= 1})


class _Prompts:
    """The warm-up's synthetic prompts, drawn from a seeded generator."""

    def __init__(self, engine: Engine, seed: int) -> None:
        self.rng, self.vocab = random.Random(seed), engine.model_config.vocab_size
        # the largest prompt that fits: the context, and half the KV pool (room for a follow-up)
        self.max_prompt = max(1, min(engine.max_context_len - 2, engine.kv.num_available * engine.kv.page_size // 2))
        self.chunk = min(engine.config.chunked_prefill_size, self.max_prompt)

    def random(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def compile_pass(self) -> list[list[int]]:
        """One prompt per length class, then a follow-up over one of them (a cached prefix)."""
        prompts = [self.random(n) for n in compile_lengths(self.chunk, self.max_prompt)]
        follow_up = prompts[len(prompts) // 2] + self.random(FOLLOW_UP_TOKENS)
        return [*prompts, follow_up[: self.max_prompt]]

    def measure_pass(self) -> list[list[int]]:
        """Whole-chunk prompts (the rate), then small ones (a batch's fixed part)."""
        sizes = [self.chunk] * MEASURE_PROMPTS + [min(OVERHEAD_TOKENS, self.chunk)] * OVERHEAD_PROMPTS
        return [self.random(n) for n in sizes]


def warm_up_prompts(loop: EngineLoop, timeout_s: float = 600.0, seed: int = 0) -> WarmupReport:
    """Run the compile and measure passes through `loop` (started, serving nothing yet); raises
    TimeoutError past `timeout_s` and RuntimeError if a warm-up request fails."""
    engine, started = loop.engine, time.monotonic()
    deadline = started + timeout_s
    prompts, mixes = _Prompts(engine, seed), engine.scheduler.policy.mixes
    ran = 0
    for measure in (False, True):
        if measure:  # what the compile pass measured is forgotten
            loop.call(engine.rates.reset).result(timeout=_left(deadline))
        batch = prompts.measure_pass() if measure else prompts.compile_pass()
        for ids in batch:
            _run_one(loop, ids, deadline)
        ran += len(batch)
        if mixes:
            beside = [prompts.random(prompts.chunk) for _ in range(MIXED_PROMPTS)]
            _run_beside_decoding(loop, prompts.random(OVERHEAD_TOKENS), beside, deadline)
            ran += 1 + len(beside)
    loop.call(lambda: _forget(loop)).result(timeout=_left(deadline))
    rates = engine.rates
    report = WarmupReport(
        ran,
        time.monotonic() - started,
        rates.prefill_tokens_per_s(),
        rates.prompt_overhead_s(),
        rates.mixed_tokens_per_s(),
    )
    log.info(
        "prompt path warm: %d prompts in %.1f s, %.0f prompt tokens/s, %.1f ms per prompt batch beside its tokens%s",
        report.prompts,
        report.seconds,
        report.prefill_tokens_per_s,
        report.prompt_overhead_s * 1e3,
        f", {report.mixed_tokens_per_s:.0f} tokens/s inside decode steps" if mixes else "",
    )
    return report


async def warm_before_serving(loop: EngineLoop, stop: asyncio.Event) -> bool:
    """`warm_up_prompts` on a worker thread, unless `stop` is set first; returns whether it ran to
    the end (False: stopped, and stopping the loop ends the thread within POLL_S)."""
    warm = asyncio.ensure_future(asyncio.to_thread(warm_up_prompts, loop))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({warm, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not warm.done():
        return False
    warm.result()  # a failed warm-up fails the node's start: its prompt path does not run
    return True


class _Pending:
    """One greedy warm-up request submitted to the loop: its first token and its end, awaitable."""

    def __init__(self, loop: EngineLoop, ids: list[int], max_new_tokens: int) -> None:
        self.loop, self.size = loop, len(ids)
        self.started, self.done = threading.Event(), threading.Event()
        self.last: RequestUpdate | None = None
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        self.req = loop.engine.make_request(ids, params, rid=f"warmup-{len(ids)}-{time.monotonic_ns()}")
        loop.submit(self.req, self._on_update)

    def _on_update(self, upd: RequestUpdate) -> None:
        if upd.tokens:
            self.started.set()
        if upd.finished:
            self.last = upd
            self.started.set()
            self.done.set()

    def wait(self, event: threading.Event, deadline: float) -> None:
        """Until `event` (started or done); raises if the engine stops or the deadline passes."""
        while not event.wait(min(POLL_S, _left(deadline))):
            if not self.loop.alive:  # stopped (a signal during start-up) or failed: nothing will finish it
                raise RuntimeError(f"prompt warm-up: the engine stopped ({self.loop.fault or 'shut down'})")
            if _left(deadline) <= 0:
                self.loop.abort(self.req.rid, "warm-up timed out")
                raise TimeoutError(f"prompt warm-up: a {self.size}-token prompt did not finish in time")

    def finish(self, deadline: float) -> None:
        """Until it ends; raises unless it ended by length or stop."""
        self.wait(self.done, deadline)
        last = self.last
        assert last is not None
        if last.finish_reason is None or last.finish_reason.value not in ("length", "stop"):
            raise RuntimeError(f"prompt warm-up: a {self.size}-token prompt failed: {last.finish_detail}")


def _run_one(loop: EngineLoop, ids: list[int], deadline: float) -> None:
    """One greedy request of two tokens (the second runs a decode or verify step), awaited."""
    _Pending(loop, ids, 2).finish(deadline)


def _run_beside_decoding(loop: EngineLoop, decoding: list[int], prompts: list[list[int]], deadline: float) -> None:
    """`prompts` submitted once a request of `decoding` decodes, so their chunks ride inside its
    decode steps (the guard sizes them), each awaited in turn, then that request."""
    first = _Pending(loop, decoding, MIXED_DECODE_TOKENS)
    first.wait(first.started, deadline)
    for ids in prompts:
        _Pending(loop, ids, 2).finish(deadline)
    first.finish(deadline)


def _forget(loop: EngineLoop) -> None:
    """On the scheduler thread: empty the prefix cache of the warm-up's pages and zero what the
    node exports (finish counts, the scheduler's counters and histograms, cache and speculative
    counters, recent prompt demand)."""
    engine = loop.engine
    cache = engine.kv.cache
    if cache is not None:
        cache.clear()
        cache.reset_stats()
    stats = engine.executor.spec_stats()
    if stats is not None:
        stats.reset()
    engine.rates.forget_demand()
    loop.io.reset_finished()
    sched = engine.scheduler
    sched.stats.update(dict.fromkeys(sched.stats, 0))
    for hist in (
        sched.cached_per_request,
        sched.queue_time,
        sched.prompt_time,
        sched.launch_time,
        engine.rates.step_time,
    ):
        hist.reset()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
