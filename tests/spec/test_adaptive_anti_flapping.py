"""Adaptive-steps slots against flapping: minimum dwell, confirmation, failed-upshift backoff, and
hovering or noisy acceptance compared with the plain EMA rule."""

from __future__ import annotations

import random

import pytest

from spec.adaptive import SlotConfig, StepSlot
from tests.spec.adaptive_kit import Feed, PlainEmaRule, drive, geometric_feed


def test_min_dwell_holds_a_switch() -> None:
    slot = StepSlot(
        SlotConfig((1, 3)),
        initial_steps=1,
        ema_alpha=1.0,
        warmup_batches=0,
        update_interval=1,
        min_dwell=6,
        upshift_backoff=0,
        confirm_decisions=1,
    )
    # Up at 1 (1.0 > 0.5), then every batch says "drop" (0 <= 0.25): held until batch 1 + 6.
    assert drive(slot, lambda n, s: [1] if n == 1 else [0], 10) == [(1, 3), (7, 1)]


def test_a_switch_needs_consecutive_decisions_that_agree() -> None:
    slot = StepSlot(
        SlotConfig((1, 3, 5)),
        initial_steps=3,
        ema_alpha=1.0,
        warmup_batches=0,
        update_interval=1,
        min_dwell=0,
        upshift_backoff=0,
        confirm_decisions=3,
    )
    # 3.0 wants up, 2.0 wants to stay, 0 wants down (to 1), 2 at steps 5 wants down (to 3).
    script = [3, 2, 3, 3, 0, 3, 3, 3, 0, 2, 0]
    events = drive(slot, lambda n, s: [script[n - 1]], len(script))
    # up, stay (restart), up, up, down (restart), up, up, up -> 5 at 8; then three downs wanting
    # 1, 3, 1: the switch goes to the last one's target.
    assert events == [(8, 5), (11, 1)]


def test_failed_upshift_backs_off_doubling_and_a_success_resets_it() -> None:
    # At 3 the EMA says "go up" (2.6 > 2.5); at 5 it says "go back" (2.0 <= 2.25): every upshift
    # fails, until batch 210 from where 5 pays (4 accepted). Window = 4 * 1 + 2 = 6 batches.
    def feed(n: int, steps: int) -> list[int]:
        if steps == 3:
            return [2, 3, 3, 2, 3]  # 2.6
        return [4] if n >= 210 else [2]

    slot = StepSlot(
        SlotConfig((3, 5)),
        initial_steps=3,
        ema_alpha=1.0,
        warmup_batches=0,
        update_interval=1,
        min_dwell=2,
        upshift_backoff=8,
        upshift_backoff_max=32,
        confirm_decisions=1,
    )
    events = drive(slot, feed, 300)
    # up at 1, back at 3 (dwell 2): failure 1 -> no upshift before 3 + 8 = 11; failure 2 -> 13 + 16;
    # failure 3 -> 31 + 32; failure 4 -> capped at 32.
    assert events[:10] == [(1, 5), (3, 3), (11, 5), (13, 3), (29, 5), (31, 3), (63, 5), (65, 3), (97, 5), (99, 3)]
    ups = [n for n, s in events if s == 5]
    gaps = [b - a for a, b in zip(ups, ups[1:])]
    assert gaps[:4] == [10, 18, 34, 34]  # dwell 2 + backoff 8, 16, 32, 32
    # The genuine change at 210 wins once the backoff of the failure at 201 ends, and holds.
    assert events[-3:] == [(199, 5), (201, 3), (233, 5)] and slot.current_steps == 5
    assert slot.failed_upshifts == sum(1 for n, s in events if s == 3)

    # An upshift that holds beyond its window resets the doubling: 5 pays from 21 to 40 only.
    def feed2(n: int, steps: int) -> list[int]:
        if steps == 3:
            return [2, 3, 3, 2, 3]
        return [4] if 21 <= n <= 40 else [2]

    slot2 = StepSlot(
        SlotConfig((3, 5)),
        initial_steps=3,
        ema_alpha=1.0,
        warmup_batches=0,
        update_interval=1,
        min_dwell=2,
        upshift_backoff=8,
        upshift_backoff_max=32,
        confirm_decisions=1,
    )
    # Two failures (backoffs 8, 16); the upshift at 29 holds past 29 + 6; the drop at 41 is not a
    # failure; the next failed upshift (43 -> 45) waits 8 again, not 32; then 16.
    assert drive(slot2, feed2, 60) == [
        (1, 5),
        (3, 3),
        (11, 5),
        (13, 3),
        (29, 5),
        (41, 3),
        (43, 5),
        (45, 3),
        (53, 5),
        (55, 3),
    ]
    assert slot2.failed_upshifts == 4 and slot2.upshift_blocked_until(3) == 55 + 16


def test_backoff_is_per_level_and_never_blocks_downshifts() -> None:
    slot = StepSlot(
        SlotConfig((1, 3, 5)),
        initial_steps=3,
        ema_alpha=1.0,
        warmup_batches=0,
        update_interval=1,
        min_dwell=0,
        upshift_backoff=50,
        confirm_decisions=1,
    )
    assert slot.update([3]) and slot.current_steps == 5  # 3.0 > 2.5
    assert slot.update([2]) and slot.current_steps == 3  # 2.0 <= 2.25: failed upshift from 3
    assert slot.upshift_blocked_until(3) == 2 + 50
    assert not slot.update([3]) and slot.current_steps == 3  # blocked from level 3
    assert slot.update([0]) and slot.current_steps == 1  # downshifts still happen
    assert slot.update([1]) and slot.current_steps == 3  # level 1 is not blocked
    assert not slot.update([3]) and slot.current_steps == 3  # level 3 still is


def _plain_switches(cfg: SlotConfig, feed: Feed, batches: int) -> int:
    plain = PlainEmaRule(cfg, initial=3)
    for n in range(1, batches + 1):
        plain.update(feed(n, plain.current_steps))
    return plain.switches


@pytest.mark.parametrize("block", [1, 2, 3, 10, 25, 50])
def test_hovering_at_the_3_5_boundary_switches_far_less_than_the_plain_rule(block: int) -> None:
    # Batch means alternate 2.4 / 2.6 around the 3 <-> 5 boundary, in blocks of `block` batches;
    # with no hysteresis band (down_hysteresis 0 = up_hysteresis) the plain rule follows them.
    cfg = SlotConfig((1, 3, 5, 7), up_hysteresis=0.0, down_hysteresis=0.0)
    feed: Feed = lambda n, s: [2, 2, 3, 3, 2] if (n // block) % 2 else [3, 3, 2, 2, 3]  # noqa: E731
    batches = 3000
    plain = _plain_switches(cfg, feed, batches)
    ours = StepSlot(cfg, initial_steps=3)  # the default anti-flapping settings
    events = drive(ours, feed, batches)
    assert plain >= 60  # one switch per block, or per decision
    assert ours.switches <= 12 and ours.switches * 5 <= plain, (ours.switches, plain)
    if events:  # every upshift failed; each waited twice as long as the one before (to the cap)
        assert ours.failed_upshifts == ours.switches // 2
        ups = [n for n, steps in events if steps == 5]
        gaps = [b - a for a, b in zip(ups, ups[1:])]
        assert all(b > 1.5 * a for a, b in zip(gaps, gaps[1:])), gaps


def test_hovering_without_confirmation_relies_on_the_backoff() -> None:
    cfg = SlotConfig((1, 3, 5, 7), up_hysteresis=0.0, down_hysteresis=0.0)
    feed: Feed = lambda n, s: [2, 2, 3, 3, 2] if n % 2 else [3, 3, 2, 2, 3]  # noqa: E731
    ours = StepSlot(cfg, initial_steps=3, confirm_decisions=1)
    # Up when the EMA is above 2.5 at a decision, back at the first decision after the dwell
    # (failed), then no upshift for 64, 128, ... batches.
    assert drive(ours, feed, 3000) == [
        (20, 5),
        (45, 3),
        (110, 5),
        (135, 3),
        (270, 5),
        (295, 3),
        (560, 5),
        (585, 3),
        (1100, 5),
        (1125, 3),
        (2150, 5),
        (2175, 3),
    ]
    assert ours.failed_upshifts == 6 and ours.upshift_blocked_until(3) == 2175 + 1024


@pytest.mark.parametrize("p", [0.8, 0.85, 0.9])
def test_noisy_acceptance_switches_far_less_at_about_the_same_yield(p: float) -> None:
    # Batch size 1, each draft accepted with probability p: the EMA is noisy and the 3/5 and 5/7
    # boundaries are crossed by chance. Tokens per cost (1 + 0.15 per step) stays close.
    cfg = SlotConfig((1, 3, 5, 7))
    plain_sw = ours_sw = 0
    plain_yield, ours_yield = [], []
    for seed in range(4):
        for policy, sink, yields in (
            (PlainEmaRule(cfg, initial=3), "plain", plain_yield),
            (StepSlot(cfg, initial_steps=3), "ours", ours_yield),
        ):
            feed, tokens, cost = geometric_feed(p, seed), 0, 0.0
            for n in range(1, 3001):
                steps = policy.current_steps
                d = feed(n, steps)
                tokens, cost = tokens + sum(d) + len(d), cost + 1 + 0.15 * steps
                policy.update(d)
            yields.append(tokens / cost)
            if sink == "plain":
                plain_sw += policy.switches
            else:
                ours_sw += policy.switches
    assert ours_sw <= 0.35 * plain_sw, (ours_sw, plain_sw)
    assert sum(ours_yield) >= 0.97 * sum(plain_yield)


@pytest.mark.parametrize(
    "cands,down_h,up_h,coeff",
    [
        ((1, 3, 5, 7), -0.25, 0.0, 0.0),
        ((0, 1, 3), 0.0, 0.0, 0.0),
        ((0, 2, 4, 6), -0.3, 0.2, 1.5),
    ],
)
def test_without_anti_flapping_it_is_the_plain_rule_stepping_up_one_at_a_time(
    cands: tuple[int, ...], down_h: float, up_h: float, coeff: float
) -> None:
    cfg = SlotConfig(cands, up_hysteresis=up_h, down_hysteresis=down_h, ceiling_coeff=coeff)
    for seed in range(3):
        rng = random.Random(seed)
        ours = StepSlot(cfg, initial_steps=cands[1], min_dwell=0, upshift_backoff=0, confirm_decisions=1)
        ref = PlainEmaRule(cfg, initial=cands[1], max_up=1)
        for _ in range(3000):
            p = rng.choice((0.3, 0.6, 0.8, 0.95))
            d = [min(ours.current_steps, int(rng.expovariate(1 - p))) for _ in range(rng.randint(0, 4))]
            assert ours.update(d) == ref.update(d)
            assert (ours.current_steps, ours.ema) == (ref.current_steps, ref.ema)


def test_same_sequence_same_switches() -> None:
    def run() -> tuple[list[tuple[int, int]], float]:
        slot = StepSlot(SlotConfig((1, 3, 5, 7)), initial_steps=3)
        return drive(slot, geometric_feed(0.85, seed=0), 2000), slot.ema

    first, second = run(), run()
    assert first == second and len(first[0]) > 5
