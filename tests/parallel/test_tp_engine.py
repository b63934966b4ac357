"""Tensor parallelism on CPU over gloo: TP 2 and 3 engines equal TP 1 and transformers.

Each engine here is a real group: the test process is rank 0 and every other rank a spawned
process holding its share of the weights, KV heads and vocabulary. fp32 throughout, so the only
difference from one rank is the order of the all-reduce's additions."""

from __future__ import annotations

import queue
import random
import time
from pathlib import Path

import pytest
import torch

from engine.core import FinishReason, SamplingParams
from engine.engine import Engine, EngineConfig
from pdserve.models import BUILTIN_TARGET
from tests.engine.hf_models import write_hf_model
from tests.engine.test_engine import PROMPTS, greedy, hf_greedy

pytestmark = pytest.mark.slow


def _engine(model: Path | str, tp: int, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 2048)
    return Engine(EngineConfig(str(model), dtype="float32", tp_size=tp, **kw))


def _run_with_late_arrivals(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    rids = [eng.add_request(p, params) for p in prompts[:2]]
    got: dict[str, list[int]] = {r: [] for r in rids}
    steps = 0
    while not eng.idle or steps == 0:
        if steps == 3:  # late arrivals join the running batch
            rids += [eng.add_request(p, params) for p in prompts[2:]]
            got.update({r: [] for r in rids[2:]})
        for d in eng.step():
            got[d.rid].extend(d.token_ids)
        steps += 1
    return [got[r] for r in rids]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_with_chunked_prefill_matches_transformers(tmp_path: Path, kind: str) -> None:
    hf_dir = write_hf_model(tmp_path / kind, kind, seed=1)
    eng = _engine(hf_dir, 2, page_size=4, chunked_prefill_size=6)
    try:
        got = _run_with_late_arrivals(eng, PROMPTS, greedy(24))
        assert eng.kv.all_free
    finally:
        eng.close()
    for out, prompt in zip(got, PROMPTS):
        assert out == hf_greedy(hf_dir, prompt, 24)


def _logprob_run(tp: int, overlap: bool) -> tuple[list[list[int]], list[list[float]]]:
    target = BUILTIN_TARGET
    eng = _engine(target, tp, overlap=overlap, chunked_prefill_size=16)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=True, top_logprobs=3)
        outs = eng.generate([[5, 17, 42, 7, 99] * 7, [300, 301, 302], list(range(600, 640))], params)
        assert eng.kv.all_free
    finally:
        eng.close()
    return [o.output_ids for o in outs], [o.logprobs for o in outs]


def test_tp2_and_tp3_logprobs_equal_tp1_overlap_on_and_off() -> None:
    """The built-in model has 6 heads over 2 KV heads and a 4,096-token vocabulary: at TP 3 the
    middle rank holds both KV heads and the last vocabulary block is padded."""
    ids1, lp1 = _logprob_run(1, overlap=False)
    for tp, overlap in ((2, True), (3, False)):
        ids, lp = _logprob_run(tp, overlap)
        assert ids == ids1, (tp, overlap)
        for a, b in zip(lp, lp1):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4)


def test_tp2_mixed_batches_equal_tp1_unguarded() -> None:
    """A decode node's own prompts at TP 2: chunks ride inside decode steps (MIXED batches, whose
    decode rows each rank reads from its own FutureMap) and the output is TP 1's without a guard."""
    params = greedy(16)
    ref = _engine(BUILTIN_TARGET, 1, page_size=4, chunked_prefill_size=8)
    want = _run_with_late_arrivals(ref, PROMPTS, params)
    eng = _engine(
        BUILTIN_TARGET, 2, page_size=4, chunked_prefill_size=8, tpot_guard_ms=1000.0, mixed_chunk=True, overlap=True
    )
    try:
        got = _run_with_late_arrivals(eng, PROMPTS, params)
        assert eng.scheduler.stats["mixed_steps"] > 0
        assert eng.kv.all_free
    finally:
        eng.close()
    assert got == want


def test_tp2_warm_up_with_mixed_steps_leaves_output_and_pages_as_they_were() -> None:
    """A TP 2 decode node's warm-up runs prompts inside a decoding request's steps on every rank in
    lockstep, measures the mixed rate, and leaves every page free and the output TP 1's."""
    from engine.loop import EngineLoop, ThreadedIO
    from engine.warmup import warm_up_prompts
    from tests.engine.test_warmup import record_mixed_chunks

    params = greedy(16)
    want = _run_with_late_arrivals(_engine(BUILTIN_TARGET, 1, page_size=4, chunked_prefill_size=8), PROMPTS, params)
    config = EngineConfig(
        str(BUILTIN_TARGET), dtype="float32", tp_size=2, max_total_tokens=2048, page_size=4,
        chunked_prefill_size=64, tpot_guard_ms=60_000.0,
    )  # fmt: skip
    loop = EngineLoop(Engine(config, io=ThreadedIO())).start()
    eng = loop.engine
    try:
        chunks = record_mixed_chunks(eng.rates)
        warm_up_prompts(loop, timeout_s=120.0)
        assert sum(1 for n in chunks if n >= 64) >= 4  # two whole-chunk prompts per pass rode in decode steps
        assert loop.call(lambda: (eng.kv.all_free, eng.scheduler.stats["mixed_steps"])).result(60) == (True, 0)
        updates: list[queue.Queue] = []
        for i, ids in enumerate(PROMPTS):
            updates.append(queue.Queue())
            loop.submit(eng.make_request(ids, params, f"r{i}"), updates[-1].put)
        got = []
        for q in updates:
            tokens: list[int] = []
            while not (upd := q.get(timeout=60)).finished:
                tokens += upd.tokens
            got.append(tokens + upd.tokens)
        assert got == want
        assert loop.call(lambda: eng.kv.all_free).result(60)
    finally:
        loop.stop()
        eng.close()


def test_tp2_aborts_and_retractions_free_every_page() -> None:
    """A pool too small for everyone (retractions) and aborts at random moments: every rank keeps
    stepping in lockstep, outputs of the survivors equal TP 1's, and every page comes back."""
    target = BUILTIN_TARGET
    prompts = [[7 + i, 100 + i, 200 + i] * (4 + i) for i in range(6)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    ref = _engine(target, 1, max_total_tokens=128, page_size=4)
    want = [o.output_ids for o in ref.generate(prompts, params)]
    eng = _engine(target, 2, max_total_tokens=128, page_size=4)
    rng = random.Random(0)
    try:
        rids = [eng.add_request(p, params) for p in prompts]
        doomed = set(rng.sample(rids, 2))
        got: dict[str, list[int]] = {r: [] for r in rids}
        reasons: dict[str, FinishReason | None] = {}
        steps = 0
        while len(reasons) < len(rids):
            if steps == 5:
                for rid in doomed:
                    eng.abort(rid)
            for d in eng.step():
                got[d.rid].extend(d.token_ids)
                if d.finished:
                    reasons[d.rid] = d.finish_reason
            steps += 1
        eng.step()
        assert eng.kv.all_free
        eng.kv.check()
        assert doomed and all(reasons[r] is FinishReason.ABORT for r in doomed)
    finally:
        eng.close()
    for rid, out, ref_out in zip(rids, [got[r] for r in rids], want):
        if rid not in doomed:
            assert out == ref_out, rid


def test_a_dead_follower_fails_the_engine_within_its_deadline() -> None:
    eng = _engine(BUILTIN_TARGET, 2, tp_timeout_s=20.0)
    try:
        assert eng.fatal is None
        eng.ranks.procs[0].kill()
        deadline = time.monotonic() + 10.0
        while eng.fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.fatal is not None and "rank 1" in eng.fatal
        # the next step finds the group broken: its requests fail, nothing hangs
        started = time.monotonic()
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert out[0].finish_reason is FinishReason.ABORT
        assert time.monotonic() - started < 30.0
    finally:
        eng.close()


def test_an_idle_group_outlives_its_collective_deadline() -> None:
    """Followers wait for the next step without a deadline: a node idle for longer than
    tp_timeout_s still serves (the deadline is for collectives that started)."""
    eng = _engine(BUILTIN_TARGET, 2, tp_timeout_s=2.0)
    try:
        time.sleep(5.0)
        assert eng.fatal is None
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(out[0].output_ids) == 4 and eng.fatal is None
    finally:
        eng.close()
