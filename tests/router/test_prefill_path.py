"""The prefill path decision on scripted node states: remote vs local TTFT estimates, what makes local
impossible or unknown, the path policies; the perf report's parsing and the sizing arithmetic."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from common.defaults import DEFAULT_PAGE_SIZE
from router.nodes import NodeSpec, NodeState
from router.perf import NodePerf, PromptLedger, TtftCalibration
from router.prefill_path import (
    DECODE_AT_BUDGET,
    FASTER_LOCAL,
    FASTER_REMOTE,
    HISTORY_LOCAL,
    KV_HEADROOM,
    LOCAL_REFUSED,
    LOCAL_UNMEASURED,
    NO_PREFILL,
    POLICY,
    REMOTE_ON_TARGET,
    REMOTE_UNMEASURED,
    SHORT_LOCAL,
    PathRule,
    decide,
    local_ttft,
    remote_ttft,
    tier_rate,
)
from router.sizing import RateWindow, balanced_ratio

RATE = 10_000.0  # prompt tokens/s of every measured node here
GUARD = 0.025  # the decode's TPOT guard


def prefill(queued: int = 0, rate: float = RATE, overhead: float = 0.0, **kw: Any) -> NodeState:
    return NodeState(
        NodeSpec("prefill", "p:1", 9),
        healthy=True,
        waiting_prompt_tokens=queued,
        perf=NodePerf(prefill_tokens_per_s=rate, prompt_overhead_s=overhead),
        **kw,
    )


def decode(
    running: int = 0,
    queued: int = 0,
    rate: float = RATE,
    steps: tuple[tuple[int, float], ...] = ((1, 0.005), (8, 0.010), (64, 0.020)),
    per_step: float = 1.0,
    guard: float | None = GUARD,
    local: bool = True,
    max_tokens: int = 100_000,
    used: int = 0,
    overhead: float = 0.0,
    mixed_rate: float | None = None,
) -> NodeState:
    perf = NodePerf(
        prefill_tokens_per_s=rate,
        prompt_overhead_s=overhead,
        decode_step_s=steps,
        decode_tokens_per_step=per_step,
        tpot_guard_s=guard,
        mixed_chunk=mixed_rate is not None,
        mixed_tokens_per_s=mixed_rate or 0.0,
    )
    return NodeState(
        NodeSpec("decode", "d:1"),
        healthy=True,
        running=running,
        waiting_prompt_tokens=queued,
        perf=perf,
        local_prefill=local,
        max_tokens=max_tokens,
        used_tokens=used,
    )


def test_idle_decode_takes_a_prompt_a_saturated_prefill_would_queue() -> None:
    d = decide("auto", prefill(queued=200_000), decode(), 1000, 100)
    assert d.path == "local" and d.reason == FASTER_LOCAL
    assert d.remote_s == pytest.approx(201_000 / RATE) and d.local_s == pytest.approx(1000 / RATE)


def test_idle_prefill_beats_a_busy_decode() -> None:
    # 8 running: step 10 ms of the 25 ms budget, so prompts get 15/25 of the node's rate, after
    # the 10 ms step in flight
    d = decide("auto", prefill(), decode(running=8), 3000, 100)
    assert d.path == "remote" and d.reason == FASTER_REMOTE
    assert d.remote_s == pytest.approx(0.3) and d.local_s == pytest.approx(0.010 + 3000 / (RATE * 0.6))


def test_a_prefill_on_target_keeps_long_prompts_though_an_idle_decode_is_as_fast() -> None:
    # 100 ms on either path: only a prefill tier behind its target sends long prompts to decodes
    d = decide("auto", prefill(), decode(), 1000, 100)
    assert (d.path, d.reason) == ("remote", REMOTE_ON_TARGET)
    assert d.remote_s == pytest.approx(0.1) and d.local_s == pytest.approx(0.1)
    # 150 ms of queue: 250 ms remote, over a 200 ms target; the idle decode starts it in 100 ms
    d = decide("auto", prefill(queued=1500), decode(), 1000, 100)
    assert (d.path, d.reason) == ("local", FASTER_LOCAL)
    d = decide("auto", prefill(queued=1500), decode(), 1000, 100, rule=PathRule(remote_target_s=0.3))
    assert (d.path, d.reason) == ("remote", REMOTE_ON_TARGET)
    # overflow needs local clearly faster: under the rule's margin (half) of remote's estimate
    d = decide("auto", prefill(queued=1500), decode(), 1000, 100, rule=PathRule(overflow_margin=0.3))
    assert (d.path, d.reason) == ("remote", FASTER_REMOTE)
    with pytest.raises(ValueError, match="overflow_margin"):
        PathRule(overflow_margin=0.0)


def test_a_decode_that_mixes_its_chunks_pays_no_fixed_part_and_runs_at_its_mixed_rate() -> None:
    # 8 running: prompts get 15/25 of the node after its 10 ms step in flight; 2,048 tokens are one chunk
    apart = decide("auto", prefill(queued=8000), decode(running=8, overhead=0.01), 2048, 100)
    assert apart.local_s == pytest.approx(0.010 + (2048 / RATE + 0.01) / 0.6)
    unmeasured = decide("auto", prefill(queued=8000), decode(running=8, overhead=0.01, mixed_rate=0.0), 2048, 100)
    assert unmeasured.local_s == pytest.approx(0.010 + 2048 / RATE / 0.6)
    mixed = decide("auto", prefill(queued=8000), decode(running=8, overhead=0.01, mixed_rate=2 * RATE), 2048, 100)
    assert mixed.local_s == pytest.approx(0.010 + 2048 / (2 * RATE) / 0.6)
    assert (mixed.path, mixed.reason) == ("local", FASTER_LOCAL)
    parsed = NodePerf.parse({"mixed_chunk": True, "mixed_tokens_per_s": 5.0, "prefill_tokens_per_s": 1.0})
    assert parsed.mixed_chunk and parsed.mixed_tokens_per_s == 5.0
    assert not NodePerf.parse({"mixed_chunk": "yes"}).mixed_chunk


def test_the_faster_path_wins_on_a_decode_that_mixes_its_chunks() -> None:
    # the prefill is on its target (100 ms) and local is only a little faster: a node whose guard
    # holds every step takes it; one whose chunks are forwards of their own does not
    mixing = decide("auto", prefill(), decode(running=8, mixed_rate=2 * RATE), 1000, 100)
    assert (mixing.path, mixing.reason) == ("local", FASTER_LOCAL)
    assert mixing.local_s == pytest.approx(0.010 + 1000 / (2 * RATE) / 0.6) and mixing.remote_s == pytest.approx(0.1)
    apart = decide("auto", prefill(), decode(running=8, rate=2 * RATE / 0.6 * 1.2), 1000, 100)
    assert (apart.path, apart.reason) == ("remote", REMOTE_ON_TARGET)
    # and slower stays remote, whatever the target
    slower = decide("auto", prefill(), decode(running=8, mixed_rate=RATE), 1000, 100)
    assert (slower.path, slower.reason) == ("remote", FASTER_REMOTE)
    # the operator's rule still decides for mixing nodes
    strict = PathRule(mixed_remote_target_s=0.2, mixed_overflow_margin=0.5)
    assert decide("auto", prefill(), decode(running=8, mixed_rate=2 * RATE), 1000, 100, rule=strict).path == "remote"
    with pytest.raises(ValueError, match="overflow margins"):
        PathRule(mixed_overflow_margin=1.5)


def test_what_computes_little_on_the_decode_runs_there() -> None:
    # a follow-up turn whose history the decode caches: one chunk there
    turn = lambda node: 1000 if node.address == "d:1" else 0  # noqa: E731
    d = decide("auto", prefill(), decode(), 1200, 100, cached=turn)
    assert (d.path, d.reason) == ("local", SHORT_LOCAL)
    rule = PathRule(local_max_tokens=100, history_max_tokens=100)
    assert decide("auto", prefill(), decode(), 1200, 100, cached=turn, rule=rule).path == "remote"
    # a short prompt nothing of which the decode holds: the prefill tier's (a whole forward there)
    assert d.local_s == pytest.approx(200 / RATE) and decide("auto", prefill(), decode(), 200, 100).path == "remote"
    # a decode that cannot take prompts still refuses short ones
    assert decide("auto", prefill(), decode(running=64, guard=0.02), 10, 10).reason == DECODE_AT_BUDGET
    # nor does one measured slower at them than the prefill tier
    assert decide("auto", prefill(), decode(rate=300.0), 1200, 100, cached=turn).path == "remote"
    with pytest.raises(ValueError, match="token counts"):
        PathRule(local_max_tokens=-1)


def test_each_local_chunk_pays_the_batch_overhead_in_the_guard_share() -> None:
    # 8 running: prompts get 15/25 of the node after the 10 ms step in flight; 5,000 tokens are
    # three 2,048-token chunks, each paying a 13 ms fixed part beside its tokens
    est = local_ttft(decode(running=8, overhead=0.013), 5000, 10, 0.0)
    assert est.seconds == pytest.approx(0.010 + (5000 / RATE + 3 * 0.013) / 0.6)
    # an idle decode gives prompts all its time; one short prompt is one chunk
    assert local_ttft(decode(overhead=0.013), 100, 10, 0.0).seconds == pytest.approx(100 / RATE + 0.013)


def test_both_paths_charge_a_prompt_batch_its_fixed_cost() -> None:
    # 5,000 queued tokens on the prefill are three chunks, each with its 7 ms fixed part
    assert remote_ttft(prefill(queued=4000, overhead=0.007), 1000) == pytest.approx(0.5 + 3 * 0.007)
    # a cached follow-up: 200 tokens on a decode with 8 running (15/25 of it for prompts) against
    # 1,200 uncached ones on the prefill; by tokens alone remote is sooner (0.060 s against
    # 0.010 + (200 / 5,000 + 0.007) / 0.6 = 0.088 s)...
    # (with no history target: within one, the turn would stay where its history is, below)
    turn = lambda node: 1000 if node.address == "d:1" else 0  # noqa: E731
    slow_local = decode(running=8, overhead=0.007, rate=5_000.0)
    no_target = PathRule(history_target_s=0.0)
    assert decide("auto", prefill(rate=20_000.0), slow_local, 1200, 100, cached=turn, rule=no_target).path == "remote"
    # ...but a prefill node's batch pays the fixed cost too, and the transfer, so the turn stays
    busy_prefill = prefill(rate=20_000.0, overhead=0.040, kv_transfer_s=0.0)
    d = decide("auto", busy_prefill, slow_local, 1200, 100, cached=turn)
    assert (d.path, d.reason) == ("local", SHORT_LOCAL)
    assert d.remote_s == pytest.approx(1200 / 20_000 + 0.040) and d.local_s == pytest.approx(0.010 + 0.047 / 0.6)


def test_decode_at_its_tpot_budget_cannot_take_prompts() -> None:
    # 64 running: a 20 ms step of a 20 ms budget leaves nothing for a chunk
    busy = decode(running=64, guard=0.02)
    assert local_ttft(busy, 10, 10, 0.0).refusal == DECODE_AT_BUDGET
    d = decide("auto", prefill(queued=10**7), busy, 10, 10)
    assert d.path == "remote" and d.reason == DECODE_AT_BUDGET and d.local_s is None


def test_speculation_stretches_the_cycle_and_steps_interpolate() -> None:
    # 36 running: linear between 8 (10 ms) and 64 (20 ms) is 15 ms; a = 2 doubles the 25 ms cycle
    est = local_ttft(decode(running=36, per_step=2.0), 500, 10, 0.0)
    assert est.seconds == pytest.approx(0.015 + 500 / (RATE * (0.05 - 0.015) / 0.05))
    perf = NodePerf(decode_step_s=((1, 0.005), (4, 0.008), (8, 0.012)))
    assert perf.step_s(1) == perf.step_s(0) == 0.005  # below the smallest: its time
    assert perf.step_s(6) == pytest.approx(0.010)
    assert perf.step_s(16) == pytest.approx(0.020)  # along the last two
    assert NodePerf(decode_step_s=((4, 0.01),)).step_s(32) == 0.01
    assert NodePerf().step_s(4) is None


def test_unmeasured_rates() -> None:
    # cold prefill tier, known local: still remote, so the prefill tier gets measured first
    d = decide("auto", prefill(rate=0.0, queued=10**6), decode(), 1000, 10)
    assert (d.path, d.reason, d.remote_s) == ("remote", REMOTE_UNMEASURED, None) and d.local_s is not None
    # both unknown
    d = decide("auto", prefill(rate=0.0), decode(rate=0.0), 1000, 10)
    assert (d.path, d.remote_s, d.local_s) == ("remote", None, None)
    # decoding with no step time measured: local unknown
    d = decide("auto", prefill(queued=10**6), decode(running=3, steps=()), 1000, 10)
    assert (d.path, d.reason, d.local_s) == ("remote", LOCAL_UNMEASURED, None)
    # a decode that ran no prompt yet borrows the prefill tier's mean rate
    tier = [prefill(rate=8000.0), prefill(rate=12000.0), prefill(rate=0.0)]
    assert tier_rate(tier) == 10000.0 and tier_rate([]) == 0.0
    d = decide("auto", prefill(queued=10**6), decode(rate=0.0), 1000, 10, tier)
    assert d.path == "local" and d.local_s == pytest.approx(0.1)


def test_kv_headroom_and_router_in_flight() -> None:
    assert local_ttft(decode(max_tokens=1000, used=850), 50, 100, 0.0).seconds is not None
    assert local_ttft(decode(max_tokens=1000, used=851), 50, 100, 0.0).refusal == KV_HEADROOM
    assert local_ttft(decode(max_tokens=0), 1, 1, 0.0).refusal == KV_HEADROOM  # capacity never reported
    d = decode(max_tokens=1000)
    d.prompts.add("earlier", 900, 0.0)  # ours, queued there, holding no KV yet
    assert local_ttft(d, 50, 100, 0.0).refusal == KV_HEADROOM
    dec = decide("auto", prefill(queued=10**6), d, 50, 100)
    assert dec.path == "remote" and dec.reason == KV_HEADROOM


def test_in_flight_prompts_count_until_the_next_report() -> None:
    p = prefill(queued=1000, loads_at=10.0)
    p.prompts.add("before", 5000, 9.0)  # in the report's queued count already
    p.prompts.add("after", 2000, 11.0)
    assert remote_ttft(p, 1000) == pytest.approx((1000 + 2000 + 1000) / RATE)
    ledger = PromptLedger()
    ledger.add("a", 10, 0.0)
    ledger.settle("a")
    ledger.settle("a")  # twice: still nothing, never negative
    ledger.settle("never added")
    assert ledger.total() == 0 and ledger.since(0.0) == 0


def test_the_prefills_handoff_latency_adds_to_remote() -> None:
    p = prefill()
    p.kv_transfer_s = 0.05  # the prefill's report: last chunk computed -> final write done
    assert remote_ttft(p, 1000) == pytest.approx(0.15)
    d = decode()
    d.kv_transfer_s = 0.5  # a decode's figure is not a transfer time: it plays no part
    assert decide("auto", p, d, 1000, 100).remote_s == pytest.approx(0.15)


def test_decodes_that_refuse_local_prompts() -> None:
    for refusing in (decode(local=False), decode(guard=None)):
        assert local_ttft(refusing, 1, 1, RATE).refusal == LOCAL_REFUSED
        d = decide("auto", prefill(queued=10**7), refusing, 1, 1)
        assert (d.path, d.reason) == ("remote", LOCAL_REFUSED)
        assert decide("local", None, refusing, 1, 1).path is None
        assert decide("auto", None, refusing, 1, 1).path is None  # then colocated, or 503


def test_no_prefill() -> None:
    d = decide("auto", None, decode(running=8), 100, 10)
    assert (d.path, d.reason) == ("local", NO_PREFILL) and d.local_s is not None
    # only its rates unknown: local anyway (the only way they get measured)
    d = decide("auto", None, decode(rate=0.0), 100, 10)
    assert (d.path, d.local_s) == ("local", None)
    d = decide("auto", None, decode(max_tokens=10), 100, 10)
    assert (d.path, d.reason) == (None, KV_HEADROOM)
    assert decide("remote", None, decode(), 100, 10).path is None


def test_policies_remote_and_local() -> None:
    d = decide("remote", prefill(queued=10**7), decode(), 100, 10)
    assert (d.path, d.reason, d.remote_s, d.local_s) == ("remote", POLICY, None, None)
    d = decide("local", prefill(), decode(running=64, guard=0.02), 100, 10)
    assert (d.path, d.reason) == ("local", POLICY)  # the operator's choice: the node's guard limits it


def test_perf_report_is_parsed_defensively() -> None:
    good = {
        "prefill_tokens_per_s": 5000,
        "prompt_overhead_s": 0.013,
        "decode_step_s": {"1": 0.004, "8": 0.009, "2": 0.005},
        "decode_tokens_per_step": 2.5,
        "decode_capacity_tokens_per_s": 900.0,
        "tpot_guard_s": 0.025,
    }
    assert NodePerf.parse(good) == NodePerf(
        prefill_tokens_per_s=5000.0,
        prompt_overhead_s=0.013,
        decode_step_s=((1, 0.004), (2, 0.005), (8, 0.009)),
        decode_tokens_per_step=2.5,
        decode_capacity_tokens_per_s=900.0,
        tpot_guard_s=0.025,
    )
    bad = {
        "prefill_tokens_per_s": "fast",
        "prompt_overhead_s": -0.5,
        "decode_step_s": {"x": 1.0, "4": -1.0, "0": 0.1, "16": "slow", "2.0": 0.003},
        "decode_tokens_per_step": float("nan"),
        "decode_capacity_tokens_per_s": True,
        "tpot_guard_s": None,
    }
    assert NodePerf.parse(bad) == NodePerf(decode_step_s=((2, 0.003),))
    for garbage in (None, [], "perf", 3, {"decode_step_s": [1, 2]}, {"tpot_guard_s": -1}):
        assert NodePerf.parse(garbage) == NodePerf()


def test_rate_window_and_balanced_ratio() -> None:
    now = [1000.0]
    w = RateWindow(60.0, clock=lambda: now[0])
    assert w.per_second() == 0.0
    w.add(100)
    now[0] += 10
    w.add(200)
    assert w.per_second() == pytest.approx(300 / 10)  # the window is not full yet
    now[0] += 55
    assert w.per_second() == pytest.approx(200 / 60)  # the first event left the window
    now[0] += 61
    assert w.per_second() == 0.0
    # 2 prefill nodes' worth of prompts per 1 decode node's worth of output: ratio 2
    assert balanced_ratio(20_000, [10_000, 10_000], 1_000, [1_000, 0.0]) == pytest.approx(2.0)
    assert math.isnan(balanced_ratio(20_000, [0.0], 1_000, [1_000]))
    assert math.isnan(balanced_ratio(20_000, [10_000], 0.0, [1_000]))
    assert balanced_ratio(0.0, [10_000], 10.0, [1_000]) == 0.0


def test_a_follow_up_goes_where_its_history_is_cached() -> None:
    """A busy decode that holds the conversation beats an idle prefill that must compute it all;
    the same prompt without the decode's hit stays remote."""
    p, d = prefill(), decode(running=8)  # local runs at 15/25 of the rate, after its 10 ms step
    held = {"d:1": 3900}  # of a 4,000-token prompt: the earlier turns, on the decode
    cached = lambda node: held.get(node.address, 0)  # noqa: E731
    d_hit = decide("auto", p, d, 4000, 100, cached=cached)
    assert d_hit.path == "local" and d_hit.reason == SHORT_LOCAL
    assert d_hit.remote_s == pytest.approx(0.4) and d_hit.local_s == pytest.approx(0.010 + 100 / (RATE * 0.6))
    assert decide("auto", p, d, 4000, 100).path == "remote"
    # the prefill holding it instead: remote, computing only the rest
    held = {"p:1": 3900}
    d_p = decide("auto", p, d, 4000, 100, cached=cached)
    assert d_p.path == "remote" and d_p.remote_s == pytest.approx(0.01)


def test_a_follow_up_stays_where_more_of_its_history_is_within_the_target() -> None:
    """Remote is sooner by the rates, but the prefill would recompute the turns only the decode
    holds: within the history target the turn stays local; past it, or where the prefill holds as
    much, the faster path wins."""
    p, d = prefill(rate=20_000.0), decode(running=8, overhead=0.007, rate=5_000.0)
    held = {"d:1": 1000, "p:1": 600}  # the decode ran the last turns; the prefill holds the earlier ones
    cached = lambda node: held.get(node.address, 0)  # noqa: E731
    kept = decide("auto", p, d, 1200, 100, cached=cached)
    assert (kept.path, kept.reason) == ("local", HISTORY_LOCAL)
    assert kept.remote_s is not None and kept.local_s is not None and kept.remote_s < kept.local_s <= 0.2
    assert decide("auto", p, d, 1200, 100, cached=cached, rule=PathRule(history_target_s=0.05)).path == "remote"
    held["p:1"] = 1000  # the prefill holds as much: nothing lost by going there
    assert decide("auto", p, d, 1200, 100, cached=cached).reason == REMOTE_ON_TARGET
    held["p:1"] = 960  # the last turn's short reply only: kept where it is, or the prefill recomputes it
    assert decide("auto", p, d, 1200, 100, cached=cached).reason == HISTORY_LOCAL
    held["p:1"] = 1000 - DEFAULT_PAGE_SIZE + 1  # less than a page more: nothing a cache could keep
    assert decide("auto", p, d, 1200, 100, cached=cached).reason == REMOTE_ON_TARGET
    held["p:1"] = 600
    assert decide("auto", p, decode(running=8, rate=300.0), 1200, 100, cached=cached).path == "remote"  # too slow
    with pytest.raises(ValueError, match="targets"):
        PathRule(history_target_s=-1.0)
    with pytest.raises(ValueError, match="token counts"):
        PathRule(history_min_tokens=-1)
    with pytest.raises(ValueError, match="token counts"):
        PathRule(history_max_tokens=-1)


def test_a_whole_chat_turn_stays_with_its_history() -> None:
    """A turn's new message, the reply before it and their template run past `local_max_tokens`:
    up to `history_max_tokens` it still stays on the decode holding its history (the prefill would
    recompute what only the decode holds); past it, the faster path wins."""
    p, d = prefill(rate=20_000.0), decode(running=8, overhead=0.007, rate=5_000.0)
    held = {"d:1": 1000, "p:1": 200}
    cached = lambda node: held.get(node.address, 0)  # noqa: E731
    turn = decide("auto", p, d, 1300, 100, cached=cached)  # 300 tokens to compute on the decode
    assert (turn.path, turn.reason) == ("local", HISTORY_LOCAL)
    assert decide("auto", p, d, 1300, 100, cached=cached, rule=PathRule(history_max_tokens=0)).path == "remote"
    # the rule never holds a turn to fewer tokens than short turns may compute
    wide = PathRule(local_max_tokens=400, history_max_tokens=0)
    assert decide("auto", p, d, 1300, 100, cached=cached, rule=wide).reason == HISTORY_LOCAL
    assert decide("auto", p, d, 1600, 100, cached=cached).path == "remote"  # 600 tokens: past the limit


def test_a_short_prompt_on_a_decoding_node_waits_for_the_step_in_flight() -> None:
    """A cached turn's few new tokens start only after the decode's step in flight: that fixed part
    is in the estimate, so the calibration does not learn it as a ratio that would then stretch
    every long prompt's estimate; an idle node starts at once."""
    busy = local_ttft(decode(running=8, mixed_rate=2 * RATE), 60, 48, 0.0)
    assert busy.seconds == pytest.approx(0.010 + 60 / (2 * RATE) / 0.6)
    assert local_ttft(decode(mixed_rate=2 * RATE), 60, 48, 0.0).seconds == pytest.approx(60 / (2 * RATE))


def test_calibration_scales_the_estimates_and_relaxes_when_unobserved() -> None:
    cal = TtftCalibration()
    assert cal.current(5.0) == 1.0
    cal.observe(0.010, 0.019, now=1.0)  # an estimate under 20 ms is mostly overhead: ignored
    assert cal.ratio == 1.0 and cal.at == 0.0
    cal.observe(0.5, 0.1, now=10.0)
    assert cal.ratio == pytest.approx(1.8) and cal.current(40.0) == pytest.approx(1.4)
    # a decode whose local prompts took longer than estimated is estimated longer, and overflow
    # then stays remote
    d = decode()
    d.ttft.ratio, d.ttft.at = 4.0, 100.0
    est = local_ttft(d, 1000, 100, 0.0, now=100.0)
    assert est.seconds == pytest.approx(4 * 1000 / RATE)
    d.ttft.at = time.monotonic()  # decide reads the clock
    dec = decide("auto", prefill(queued=1500), d, 1000, 100)
    assert (dec.path, dec.reason) == ("remote", FASTER_REMOTE)
    p = prefill(queued=1500)
    p.ttft.ratio, p.ttft.at = 0.5, 100.0
    assert remote_ttft(p, 1000, now=100.0) == pytest.approx(0.5 * 2500 / RATE)
