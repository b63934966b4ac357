"""A node's prompt-path warm-up: it measures the prompt rate on its measure pass alone, returns
every page, leaves no cache, counts or acceptance behind, and changes no output; a stopped loop
ends it."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from engine.loop import EngineLoop, ThreadedIO
from engine.scheduler.rates import NodeRates
from engine.warmup import (
    MEASURE_PROMPTS,
    MIXED_PROMPTS,
    OVERHEAD_PROMPTS,
    compile_lengths,
    warm_before_serving,
    warm_up_prompts,
)
from fixtures.tiny_eagle import write_tiny_eagle_head
from spec.config import SpecConfig
from spec.registry import bind

TIMEOUT = 60.0
PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], list(range(100, 141))]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _eagle_loop(target, head) -> EngineLoop:
    cfg = SpecConfig("EAGLE", str(head), 3, 1)
    config = EngineConfig(str(target), page_size=4, chunked_prefill_size=64, max_total_tokens=4096)
    return EngineLoop(Engine(config, algorithm=bind(cfg), io=ThreadedIO())).start()


def _outputs(lp: EngineLoop) -> list[tuple[list[int], int | None]]:
    outs = []
    for i, ids in enumerate(PROMPTS):
        q: queue.Queue = queue.Queue()
        lp.submit(lp.engine.make_request(ids, GREEDY, f"r{i}"), q.put)
        tokens: list[int] = []
        while not (upd := q.get(timeout=TIMEOUT)).finished:
            tokens += upd.tokens
        outs.append((tokens + upd.tokens, upd.accepted_drafts))
    return outs


def record_mixed_chunks(rates: NodeRates) -> list[int]:
    """The prompt tokens of every mixed batch `rates` is told of from now on (it still learns them)."""
    chunks: list[int] = []
    observe = rates.observe_mixed

    def spy(decode_rows: int, prompt_tokens: int, decoded: int, seconds: float) -> None:
        chunks.append(prompt_tokens)
        observe(decode_rows, prompt_tokens, decoded, seconds)

    rates.observe_mixed = spy  # type: ignore[method-assign]
    return chunks


@pytest.fixture(scope="module")
def head(tiny_llama_dir, tmp_path_factory):
    return write_tiny_eagle_head(tmp_path_factory.mktemp("head") / "h", tiny_llama_dir)


def test_compile_lengths_cover_every_class_up_to_the_chunk_and_a_second_chunk():
    assert compile_lengths(256, 10_000) == [5, 16, 37, 64, 200, 256, 293]
    assert compile_lengths(2048, 1500) == [5, 16, 37, 64, 200, 256, 700, 1024, 1500]


def test_warm_up_measures_warm_prompts_and_leaves_nothing_behind(tiny_llama_dir, head):
    cold = _eagle_loop(tiny_llama_dir, head)
    try:
        want = _outputs(cold)
    finally:
        cold.stop()
    lp = _eagle_loop(tiny_llama_dir, head)
    try:
        eng = lp.engine
        report = warm_up_prompts(lp, timeout_s=TIMEOUT)
        assert report.prompts == len(compile_lengths(64, 10_000)) + 1 + MEASURE_PROMPTS + OVERHEAD_PROMPTS
        assert report.prefill_tokens_per_s > 0 and eng.rates.prefill_tokens_per_s() == report.prefill_tokens_per_s

        def state():
            cache = eng.kv.cache
            counts = {**cache.stats, **eng.scheduler.stats, "verifies": eng.executor.spec_stats().verifies}
            return eng.kv.all_free, cache.num_pages, counts, eng.scheduler.queue_time.snapshot()[1]

        all_free, cached, counts, queued_s = lp.call(state).result(TIMEOUT)
        assert all_free and cached == 0 and set(counts.values()) == {0} and queued_s == 0
        assert lp.io.finished_counts() == {}
        assert eng.rates.recent_prompt_tokens_per_s() == 0.0
        assert _outputs(lp) == want  # same tokens, same acceptance
        assert lp.call(lambda: eng.kv.all_free).result(TIMEOUT)
    finally:
        lp.stop()


def test_a_stopped_loop_ends_the_warm_up(tiny_llama_dir):
    config = EngineConfig(str(tiny_llama_dir), page_size=4, chunked_prefill_size=64)
    lp = EngineLoop(Engine(config, io=ThreadedIO())).start()
    lp.stop()
    with pytest.raises(RuntimeError, match="engine stopped"):
        warm_up_prompts(lp, timeout_s=TIMEOUT)


def test_a_stop_signal_during_warm_up_returns_without_waiting_for_it(tiny_llama_dir):
    config = EngineConfig(str(tiny_llama_dir), page_size=4, chunked_prefill_size=64)
    lp = EngineLoop(Engine(config, io=ThreadedIO())).start()
    gate = threading.Event()
    real = lp.engine.scheduler.step

    def slow_step():  # the warm-up cannot finish until the test lets it
        gate.wait(TIMEOUT)
        return real()

    lp.engine.scheduler.step = slow_step

    async def go() -> bool:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        ran = await asyncio.wait_for(warm_before_serving(lp, stop), TIMEOUT)
        gate.set()
        lp.stop()  # what the node does next; the warm-up's thread then ends (asyncio.run joins it)
        return ran

    try:
        assert asyncio.run(go()) is False
    finally:
        lp.stop()
        gate.set()


def test_a_node_that_mixes_chunks_into_decode_steps_measures_them_before_serving(tiny_llama_dir):
    """A decode node under a TPOT guard also runs prompts beside a decoding request in both passes:
    its mixed steps are measured before its first real prompt, and nothing is left behind."""

    def guarded_loop() -> EngineLoop:
        config = EngineConfig(str(tiny_llama_dir), page_size=4, chunked_prefill_size=64, tpot_guard_ms=60_000.0)
        return EngineLoop(Engine(config, io=ThreadedIO())).start()

    cold = guarded_loop()
    try:
        want = _outputs(cold)
    finally:
        cold.stop()
    lp = guarded_loop()
    try:
        eng = lp.engine
        assert eng.scheduler.policy.mixes
        chunks = record_mixed_chunks(eng.rates)
        report = warm_up_prompts(lp, timeout_s=TIMEOUT)
        plain = len(compile_lengths(64, 10_000)) + 1 + MEASURE_PROMPTS + OVERHEAD_PROMPTS
        assert report.prompts == plain + 2 * (1 + MIXED_PROMPTS)
        # each pass's prompts (a whole chunk each) rode inside the decoding request's steps
        assert sum(1 for n in chunks if n >= 64) >= 2 * MIXED_PROMPTS
        assert report.mixed_tokens_per_s == eng.rates.mixed_tokens_per_s()
        assert lp.call(lambda: (eng.kv.all_free, eng.scheduler.stats["mixed_steps"])).result(TIMEOUT) == (True, 0)
        assert _outputs(lp) == want
    finally:
        lp.stop()
