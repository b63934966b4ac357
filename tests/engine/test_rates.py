"""Node rates: batch-size buckets, the step-time line, decayed ratios and recent per-second rates."""

from __future__ import annotations

import pytest

from engine.core import ForwardMode
from engine.scheduler.rates import RATE_SAMPLES, RECENT_BATCHES, NodeRates, RecentRate, bucket, interpolate


def test_buckets_are_powers_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 16, 128]


def test_step_time_is_linear_between_and_beyond_the_measured_sizes():
    points = {1: 0.010, 4: 0.013, 16: 0.025}
    assert interpolate({}, 3) is None
    assert interpolate({8: 0.02}, 100) == 0.02
    assert interpolate(points, 2) == pytest.approx(0.011)
    assert interpolate(points, 10) == pytest.approx(0.019)
    assert interpolate(points, 32) == pytest.approx(0.041)  # along the last two
    assert interpolate({2: 0.01, 4: 0.03}, 1) == 0.01  # below the smallest: its time, an upper bound
    assert interpolate({2: 0.03, 4: 0.01}, 64) == 0.01  # past the largest, a falling line stays flat
    assert interpolate({2: 0.03, 4: 0.01}, 3) == pytest.approx(0.02)  # between them, as measured


def test_rates_follow_recent_batches():
    rates = NodeRates()
    assert rates.prefill_tokens_per_s() == 0 and rates.decode_step_s(4) is None
    rates.observe(ForwardMode.EXTEND, 2, 1000, 0.1)
    assert rates.prefill_tokens_per_s() == pytest.approx(10_000)
    for _ in range(50):  # the node got faster: old batches fade
        rates.observe(ForwardMode.EXTEND, 2, 2000, 0.1)
    assert rates.prefill_tokens_per_s() == pytest.approx(20_000, rel=0.01)
    rates.observe(ForwardMode.DECODE, 4, 10, 0.02)  # 2.5 tokens per request per step
    rates.observe(ForwardMode.DECODE, 16, 40, 0.04)
    assert rates.step_times() == {4: pytest.approx(0.02), 16: pytest.approx(0.04)}
    assert rates.decode_tokens_per_step() == pytest.approx(2.5)
    # at 64 requests: a step of 0.02 + 60 * 0.02 / 12 s, 2.5 tokens each
    assert rates.decode_capacity_tokens_per_s(64) == pytest.approx(64 * 2.5 / 0.12)
    rates.observe(ForwardMode.DECODE, 4, 10, 0.0)  # an untimed batch changes nothing
    assert rates.step_times()[4] == pytest.approx(0.02)


def test_small_prompt_batches_do_not_decide_the_prompt_rate():
    """A batch of a few tokens costs a whole forward: a probe or a cached follow-up would make a
    fast node look slow (the router then never sends it a prompt)."""
    rates = NodeRates()
    rates.observe(ForwardMode.EXTEND, 1, 8, 0.01)  # the only batch so far: it is what is known
    assert rates.prefill_tokens_per_s() == pytest.approx(800)
    for _ in range(40):
        rates.observe(ForwardMode.EXTEND, 1, 2048, 0.05)
    for _ in range(RECENT_BATCHES // 2 - 1):  # probes and one-token follow-ups between prompts
        rates.observe(ForwardMode.EXTEND, 1, 1, 0.006)
        rates.observe(ForwardMode.EXTEND, 1, 300, 0.012)  # under 512 and under half of 2,048: skipped too
    assert rates.prefill_tokens_per_s() == pytest.approx(2048 / 0.05, rel=0.01)
    for _ in range(RECENT_BATCHES):  # only short batches for a while: they are what the node runs now
        rates.observe(ForwardMode.EXTEND, 1, 1, 0.006)
        rates.observe(ForwardMode.EXTEND, 1, 300, 0.012)
    assert rates.prefill_tokens_per_s() == pytest.approx(300 / 0.012)
    for _ in range(5):
        rates.observe(ForwardMode.EXTEND, 2, 600, 0.02)  # 512 tokens and up always count
    assert rates.prefill_tokens_per_s() == pytest.approx(600 / 0.02)
    # a node that only ever sees short prompts still measures them
    short = NodeRates()
    for n in (40, 24, 48, 30):
        short.observe(ForwardMode.EXTEND, 1, n, 0.004)
    assert short.prefill_tokens_per_s() == pytest.approx((40 + 24 + 48 + 30) / 0.016, rel=0.1)


def test_a_batch_that_paid_a_compile_does_not_decide_the_prompt_rate():
    """A first-touch kernel compile makes one batch take seconds; the next few normal ones decide."""
    rates = NodeRates()
    rates.observe(ForwardMode.EXTEND, 1, 256, 0.9)  # 284 tokens/s: the kernels compiled
    assert rates.prefill_tokens_per_s() == pytest.approx(256 / 0.9)
    for _ in range(5):
        rates.observe(ForwardMode.EXTEND, 1, 200, 0.005)
    assert rates.prefill_tokens_per_s() == pytest.approx(40_000)
    # a decode node whose guard cut prompts into 32-token chunks after a compile-slowed 256
    stuck = NodeRates()
    stuck.observe(ForwardMode.EXTEND, 1, 256, 0.9)
    for _ in range(RECENT_BATCHES + RATE_SAMPLES):
        stuck.observe(ForwardMode.EXTEND, 1, 32, 0.006)
    assert stuck.prefill_tokens_per_s() == pytest.approx(32 / 0.006)  # measured again: chunks can grow


def test_recent_rate_counts_the_window_only():
    r = RecentRate(window_s=10)
    r._start = 0.0
    for t in range(20):
        r.add(100, now=float(t))
    assert r.per_second(now=19.5) == pytest.approx(100 * 10 / 10)
    assert r.per_second(now=40.0) == 0.0


def test_prompt_overhead_is_what_small_batches_cost_beyond_their_tokens():
    rates = NodeRates()
    assert rates.prompt_overhead_s() == 0.0
    rates.observe(ForwardMode.EXTEND, 1, 32, 0.013)  # no rate yet: unknown
    assert rates.prompt_overhead_s() == 0.0
    for _ in range(3):
        rates.observe(ForwardMode.EXTEND, 1, 2000, 0.05)  # 40,000 tokens/s
    rates.observe(ForwardMode.EXTEND, 1, 120, 0.016)  # 3 ms of tokens
    assert rates.prompt_overhead_s() == pytest.approx(0.0126)  # the median of 12.2 and 13 ms
    assert rates.snapshot(8)["prompt_overhead_s"] == rates.prompt_overhead_s()
    rates.reset()
    assert rates.prompt_overhead_s() == 0.0 and rates.prefill_tokens_per_s() == 0.0


def test_a_buckets_step_time_sits_at_the_batch_size_it_was_measured_at():
    """Steps of 129-256 requests share a bucket; measured near 140, their time is placed at 140,
    so a step of 134 is priced between 100's and 140's, not as one of 100 (the bucket's bound)."""
    rates = NodeRates()
    for _ in range(20):
        rates.observe(ForwardMode.DECODE, 100, 100, 0.010)
        rates.observe(ForwardMode.DECODE, 140, 140, 0.012)
    assert rates.step_times() == {128: pytest.approx(0.010), 256: pytest.approx(0.012)}  # the metric's buckets
    assert rates.step_line() == {100: pytest.approx(0.010), 140: pytest.approx(0.012)}
    assert rates.decode_step_s(134) == pytest.approx(0.010 + 0.002 * 34 / 40)
    assert rates.snapshot(256)["decode_step_s"] == {"100": pytest.approx(0.010), "140": pytest.approx(0.012)}


def test_a_host_bound_launch_is_charged_at_least_its_own_launch_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """With overlap, the batch before is collected after this one's launch. An eager 800-token
    prompt whose launch took 47 ms ran its kernels meanwhile: charged from that collection alone it
    cost 3 ms (266K tokens/s, an EAGLE decode node's reading on two H200s); it is charged its 47."""
    from engine import core
    from engine.scheduler import rates as rates_module

    clock = iter([0.047, 0.050])  # the decode step before collected, then the prompt
    monkeypatch.setattr(rates_module.time, "perf_counter", lambda: next(clock))
    rates = NodeRates()
    req = core.Req(rid="p", prompt_ids=list(range(800)), params=core.SamplingParams(max_new_tokens=4))
    decode = core.Batch(ForwardMode.DECODE, [req], [1], [True])
    rates.batch_done(decode, core.StepOutput(tokens=[[1]]), launched_at=-0.010, launch_s=0.0005)
    prompt = core.Batch(ForwardMode.EXTEND, [req], [800], [True])
    rates.batch_done(prompt, core.StepOutput(tokens=[[2]]), launched_at=0.0, launch_s=0.047)
    assert rates.prefill_tokens_per_s() == pytest.approx(800 / 0.047)
    # an asynchronous launch (fast) is still charged from the batch before it: its own device time
    fast = NodeRates()
    clock = iter([0.020, 0.038])
    fast.batch_done(decode, core.StepOutput(tokens=[[1]]), launched_at=0.0, launch_s=0.0005)
    fast.batch_done(prompt, core.StepOutput(tokens=[[2]]), launched_at=0.002, launch_s=0.002)
    assert fast.prefill_tokens_per_s() == pytest.approx(800 / 0.018)
