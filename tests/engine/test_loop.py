"""The threaded serving loop: submissions from other threads, calls in the scheduler thread,
held KV for PD prefill, and a failing step that aborts requests but keeps the loop alive."""

from __future__ import annotations

import queue
import threading

import pytest

from engine.core import FinishReason, SamplingParams

TIMEOUT = 20.0


def _collect(lp, req):
    q: queue.Queue = queue.Queue()
    lp.submit(req, q.put)
    tokens = []
    while True:
        upd = q.get(timeout=TIMEOUT)
        tokens += upd.tokens
        if upd.finished:
            return tokens, upd


def test_requests_from_many_threads_complete(loop):
    eng = loop.engine
    results = {}

    def client(i):
        req = eng.make_request([1 + i, 2, 3], SamplingParams(max_new_tokens=6, temperature=0.0), f"t{i}")
        results[i] = _collect(loop, req)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert all(len(results[i][0]) == 6 and results[i][1].finish_reason is FinishReason.LENGTH for i in range(6))
    assert loop.call(lambda: eng.kv.all_free).result(TIMEOUT)
    assert loop.call(lambda: threading.current_thread().name).result(TIMEOUT) == "pdserve-scheduler"


def test_held_kv_survives_finish_until_released(loop):
    eng = loop.engine
    req = eng.make_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=1, temperature=0.0), "held")
    req.hold_kv = True
    tokens, upd = _collect(loop, req)
    assert len(tokens) == 1 and upd.finished
    pages = loop.call(lambda: eng.kv.page_list(req)).result(TIMEOUT)
    assert pages and req.seq_len == 5  # prompt KV kept for the transfer
    # the finishing update names them: the prefill node ships them without asking the scheduler
    assert upd.held_pages is not None and list(upd.held_pages) == pages
    loop.call(lambda: eng.scheduler.release_kv(req)).result(TIMEOUT)
    assert loop.call(lambda: eng.kv.all_free).result(TIMEOUT)


def test_a_failing_step_fails_its_request_and_the_loop_goes_on(loop):
    eng = loop.engine
    real_step = eng.executor.step
    calls = {"n": 0}

    def flaky(batch, relay):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step(batch, relay)

    eng.executor.step = flaky
    _, upd = _collect(loop, eng.make_request([1, 2], SamplingParams(max_new_tokens=20), "x"))
    assert upd.finish_reason is FinishReason.ABORT and "boom" in upd.finish_detail
    # greedy, past EOS: three tokens whatever the weights (sampled, it drew EOS after two in CI)
    y = eng.make_request([1, 2], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True), "y")
    tokens, upd = _collect(loop, y)
    # the step failed inside the scheduler (its request alone in the batch: that one failed);
    # nothing escaped to the loop, which would have failed everything in flight
    assert len(tokens) == 3 and eng.scheduler.stats["failed_steps"] == 1 and loop.steps_failed == 0
    assert loop.call(lambda: eng.kv.all_free).result(TIMEOUT)


def test_engine_threads_bind_an_indexed_gpu_only(monkeypatch):
    """cuda:N becomes the thread's current device; bare "cuda" (the current one) and the CPU
    leave it alone (torch refuses set_device without an index)."""
    import torch

    from engine.engine import bind_thread_to_device

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for name in ("cpu", "cuda", "cuda:1"):
        bind_thread_to_device(torch.device(name))
    assert calls == [1]


def test_a_second_live_request_with_the_same_id_is_refused(loop):
    """Ids key updates and aborts: a duplicate is refused at once, the first is untouched, and the
    id is free again once the first finished."""
    from engine.core import InvalidRequest

    eng = loop.engine
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    q: queue.Queue = queue.Queue()
    loop.submit(eng.make_request([1, 2, 3], params, "same"), q.put)
    with pytest.raises(InvalidRequest, match="already in flight"):
        loop.submit(eng.make_request([4, 5, 6], params, "same"), lambda upd: None)
    tokens = []
    while True:
        upd = q.get(timeout=TIMEOUT)
        tokens += upd.tokens
        if upd.finished:
            break
    assert len(tokens) == 40 and upd.finish_reason is FinishReason.LENGTH
    again, _ = _collect(loop, eng.make_request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0), "same"))
    assert len(again) == 3
