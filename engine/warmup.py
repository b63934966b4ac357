"""Prompt-path warm-up at node start: first-touch kernel compiles paid before the first request,
and the prompt rate measured on warm kernels.

A GPU node captures its decode graphs at start-up, but its prompt path (extend attention of each
length class, a prompt over a cached prefix, the draft's prefill) compiles on first use: seconds
that the first real prompts would pay, and that the node's measured prompt rate (which the router
and the TPOT guard read) would take as the node's speed. So before it serves, the node runs a few
synthetic prompts through its own scheduler: one per length class, then a follow-up over a cached
prefix (the compile pass); then it forgets what the compile pass measured and times a few prompts
of a whole chunk and a few small ones (the measure pass: the prompt rate, and a batch's fixed
part). Their KV returns to the pool, the prefix cache is emptied, and the counters the node
exports start from zero.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass

from common.sampling import SamplingParams
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
POLL_S = 0.1  # how often a wait looks whether the engine still runs


@dataclass(frozen=True)
class WarmupReport:
    prompts: int
    seconds: float
    prefill_tokens_per_s: float
    prompt_overhead_s: float


def compile_lengths(max_chunk: int, max_prompt: int) -> list[int]:
    """The compile pass's prompt lengths: every class up to the chunk, the chunk itself, and a
    prompt one odd piece longer (its second chunk runs over the first's KV)."""
    lengths = [n for n in COMPILE_LENGTHS if n < max_chunk] + [max_chunk, max_chunk + 37]
    return sorted({min(n, max_prompt) for n in lengths if n >= 1})


def warm_up_prompts(loop: EngineLoop, timeout_s: float = 600.0, seed: int = 0) -> WarmupReport:
    """Run the compile and measure passes through `loop` (started, serving nothing yet); raises
    TimeoutError past `timeout_s` and RuntimeError if a warm-up request fails."""
    engine, started = loop.engine, time.monotonic()
    deadline = started + timeout_s
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    # the largest prompt that fits: the context, and half the KV pool (room to spare for a follow-up)
    max_prompt = max(1, min(engine.max_context_len - 2, engine.kv.num_available * engine.kv.page_size // 2))
    chunk = min(engine.config.chunked_prefill_size, max_prompt)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in compile_lengths(chunk, max_prompt)]
    prefix = prompts[len(prompts) // 2]
    follow_up = prefix + [rng.randrange(vocab) for _ in range(FOLLOW_UP_TOKENS)]
    for ids in [*prompts, follow_up[:max_prompt]]:
        _run_one(loop, ids, deadline)
    loop.call(engine.rates.reset).result(timeout=_left(deadline))
    for n in [chunk] * MEASURE_PROMPTS + [min(OVERHEAD_TOKENS, chunk)] * OVERHEAD_PROMPTS:
        _run_one(loop, [rng.randrange(vocab) for _ in range(n)], deadline)
    loop.call(lambda: _forget(loop)).result(timeout=_left(deadline))
    report = WarmupReport(
        len(prompts) + 1 + MEASURE_PROMPTS + OVERHEAD_PROMPTS,
        time.monotonic() - started,
        engine.rates.prefill_tokens_per_s(),
        engine.rates.prompt_overhead_s(),
    )
    log.info(
        "prompt path warm: %d prompts in %.1f s, %.0f prompt tokens/s, %.1f ms per prompt batch beside its tokens",
        report.prompts,
        report.seconds,
        report.prefill_tokens_per_s,
        report.prompt_overhead_s * 1e3,
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


def _run_one(loop: EngineLoop, ids: list[int], deadline: float) -> None:
    """One greedy request of two tokens (the second runs a decode or verify step), awaited."""
    done = threading.Event()
    last: list[RequestUpdate] = []

    def on_update(upd: RequestUpdate) -> None:
        if upd.finished:
            last.append(upd)
            done.set()

    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    req = loop.engine.make_request(ids, params, rid=f"warmup-{len(ids)}-{time.monotonic_ns()}")
    loop.submit(req, on_update)
    while not done.wait(min(POLL_S, _left(deadline))):
        if not loop.alive:  # stopped (a signal during start-up) or failed: nothing will finish it
            raise RuntimeError(f"prompt warm-up: the engine stopped ({loop.fault or 'shut down'})")
        if _left(deadline) <= 0:
            loop.abort(req.rid, "warm-up timed out")
            raise TimeoutError(f"prompt warm-up: a {len(ids)}-token prompt did not finish in time")
    if last[0].finish_reason is None or last[0].finish_reason.value not in ("length", "stop"):
        raise RuntimeError(f"prompt warm-up: a {len(ids)}-token prompt failed: {last[0].finish_detail}")


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
    for hist in (sched.cached_per_request, sched.queue_time, sched.prompt_time, sched.launch_time):
        hist.reset()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
