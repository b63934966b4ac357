"""Adaptive-steps slots: EMA and hysteresis on scripted acceptance, shadow scores, anti-flapping
(the controller over the slots: tests/spec/test_adaptive_controller.py)."""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

import pytest

from spec.adaptive import AdaptiveConfigError, SlotConfig, StepSlot
from spec.adaptive.slot import SHADOW_FRESH, SHADOW_UPSHIFT

Feed = Callable[[int, int], Sequence[int]]  # (batch number from 1, current steps) -> accepted drafts

# Decisions on every batch, the EMA equal to the last batch mean: thresholds can be hit exactly.
EXACT = dict(ema_alpha=1.0, warmup_batches=0, update_interval=1, min_dwell=0, upshift_backoff=0,
             confirm_decisions=1)


def drive(slot: StepSlot, feed: Feed, batches: int) -> list[tuple[int, int]]:
    """Run `batches` updates; the (batch, new steps) of every switch."""
    events = []
    for n in range(1, batches + 1):
        if slot.update(feed(n, slot.current_steps)):
            events.append((n, slot.current_steps))
    assert slot.batches == batches and slot.switches == len(events)
    return events


class PlainEmaRule:
    """SGLang's merged EMA rule, written here independently as the baseline without anti-flapping:
    no dwell, no backoff, and the upward walk goes as far as the EMA allows (max_up=None) or one
    candidate (max_up=1)."""

    def __init__(self, cfg: SlotConfig, initial: int, alpha: float = 0.2, warmup: int = 10,
                 interval: int = 5, max_up: int | None = None) -> None:
        self.c, self.alpha, self.warmup, self.interval, self.max_up = cfg, alpha, warmup, interval, max_up
        self.current_steps, self.ema, self.n, self.switches = initial, initial - 1.0, 0, 0

    def update(self, d: Sequence[int]) -> bool:
        if not d:
            return False
        if self.current_steps > 0:
            self.ema = (1 - self.alpha) * self.ema + self.alpha * (sum(d) / len(d))
        self.n += 1
        if self.n <= self.warmup or (self.n - self.warmup) % self.interval:
            return False
        cands, e = self.c.candidate_steps, self.ema
        i = j = cands.index(self.current_steps)
        if self.current_steps == 0:
            if i + 1 == len(cands):
                return False
            j = i + 1
            if e < 0:
                self.ema = cands[j] - 1.0
        else:
            while j > 0 and e <= (0.5 if cands[j - 1] == 0 else cands[j - 1] - 0.5) + self.c.down_hysteresis:
                j -= 1
            while (j >= i and j + 1 < len(cands) and e > cands[j] - 0.5 + self.c.up_hysteresis
                   and (self.max_up is None or j - i < self.max_up)):
                j += 1
            if cands[j] <= self.current_steps and self.c.ceiling_coeff > 0:
                ceiling = max(1, math.ceil(e * self.c.ceiling_coeff))
                below = [s for s in cands if s <= ceiling]
                j = min(j, cands.index(below[-1] if below else cands[0]))
        changed = cands[j] != self.current_steps
        self.current_steps, self.switches = cands[j], self.switches + changed
        return changed


def geometric_feed(p: float, seed: int, batch_size: int = 1) -> Feed:
    """Each request accepts each further draft with probability p, at most `steps` drafts: a real
    draft's acceptance depends on the step count it ran with."""
    rng = random.Random(seed)

    def feed(_: int, steps: int) -> list[int]:
        out = []
        for _ in range(batch_size):
            k = 0
            while k < steps and rng.random() < p:
                k += 1
            out.append(k)
        return out
    return feed


# ---------------------------------------------------------------- EMA and hysteresis ---------

def test_initial_state_and_ema_seed() -> None:
    cands = SlotConfig((1, 3, 5, 7))
    assert StepSlot(cands, initial_steps=5).current_steps == 5
    assert StepSlot(cands, initial_steps=5).ema == 4.0  # steps - 1
    assert StepSlot(cands, initial_steps=4).current_steps == 3  # tie between 3 and 5: the lower
    assert StepSlot(cands, initial_steps=100).current_steps == 7
    assert StepSlot(cands).current_steps == 3  # none given: the (lower) middle candidate
    zero = StepSlot(SlotConfig((0, 1, 3)), initial_steps=0)
    assert (zero.current_steps, zero.ema, zero.switches, zero.batches) == (0, -1.0, 0, 0)


def test_settings_are_validated_like_the_config() -> None:
    with pytest.raises(AdaptiveConfigError, match="ema_alpha"):
        StepSlot(SlotConfig((1,)), ema_alpha=0)
    with pytest.raises(AdaptiveConfigError, match="update_interval"):
        StepSlot(SlotConfig((1,)), update_interval=0)


def test_ema_follows_batch_means_and_empty_batches_are_ignored() -> None:
    slot = StepSlot(SlotConfig((1, 3, 5, 7)), initial_steps=3, ema_alpha=0.5)
    assert slot.update([]) is False and slot.batches == 0 and slot.ema == 2.0
    slot.update([0, 1])  # mean 0.5
    assert slot.ema == pytest.approx(1.25) and slot.batches == 1
    slot.update([3])
    assert slot.ema == pytest.approx(2.125) and slot.batches == 2


def test_high_acceptance_climbs_one_candidate_at_a_time() -> None:
    every_draft = lambda n, steps: [steps] * 4  # noqa: E731 (every draft accepted)
    # Defaults: warmup 10, interval 5, dwell 16, two agreeing decisions. First decisions at 15
    # and 20 (after warmup, on the interval grid); after the switch at 20 the next decisions are
    # the grid points at least min_dwell later (40, 45), and so on.
    slot = StepSlot(SlotConfig((1, 3, 5, 7)), initial_steps=1)
    assert drive(slot, every_draft, 100) == [(20, 3), (45, 5), (70, 7)]
    # The plain rule may walk several levels at once when the EMA is far above.
    far_above = lambda n, steps: [6]  # noqa: E731 (scripted: ignores the cap of `steps`)
    ours = StepSlot(SlotConfig((1, 3, 5, 7)), initial_steps=1)
    plain = PlainEmaRule(SlotConfig((1, 3, 5, 7)), initial=1)
    assert drive(ours, far_above, 100) == [(20, 3), (45, 5), (70, 7)]
    assert [n for n in range(1, 100) if plain.update([6])] == [15] and plain.current_steps == 7


def test_low_acceptance_drops_several_levels_at_once() -> None:
    slot = StepSlot(SlotConfig((1, 3, 5, 7)), initial_steps=7)
    assert drive(slot, lambda n, s: [0, 0], 40) == [(20, 1)]  # ema 6 * 0.8**20 = 0.07 <= 0.25
    to_plain = StepSlot(SlotConfig((0, 1, 3), down_hysteresis=0.0), initial_steps=3)
    assert drive(to_plain, lambda n, s: [0], 20) == [(20, 0)]


def test_update_interval_and_warmup_gate_decisions() -> None:
    slot = StepSlot(SlotConfig((1, 3)), initial_steps=1, ema_alpha=1.0, warmup_batches=3,
                    update_interval=4, min_dwell=0, confirm_decisions=1)
    assert drive(slot, lambda n, s: [0] if n < 8 else [1], 30) == [(11, 3)]  # grid: 7, 11, 15...


@pytest.mark.parametrize("start,drafts,expected", [
    (3, [2, 3], 3),  # ema 2.5 == 3 - 0.5 + up_h: equality does not upshift
    (3, [2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2], 5),  # 2.5 + 1/12 > 2.5: up
    (5, [2, 2, 2, 3], 3),  # ema 2.25 == 3 - 0.5 - 0.25: equality downshifts
    (5, [2, 2, 3, 3, 2, 2, 2, 3], 5),  # 2.375: above the drop threshold, stays
    (7, [0, 0, 0, 1], 1),  # 0.25: at or below 4.25, 2.25 and 0.25: three levels at once
    (7, [0, 1], 3),  # 0.5: below 4.25 and 2.25, above 0.25
])
def test_thresholds_exactly(start: int, drafts: list[int], expected: int) -> None:
    slot = StepSlot(SlotConfig((1, 3, 5, 7), up_hysteresis=0.0, down_hysteresis=-0.25),
                    initial_steps=start, **EXACT)
    assert slot.update(drafts) is (expected != start)
    assert slot.current_steps == expected


@pytest.mark.parametrize("drafts,expected", [([0, 1], 0), ([1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1], 3)])
def test_dropping_to_plain_decoding_uses_its_own_threshold(drafts: list[int], expected: int) -> None:
    # At steps 1 over [0, 1, 3] with no hysteresis: 0.5 is both the drop-to-0 and the up threshold.
    slot = StepSlot(SlotConfig((0, 1, 3), down_hysteresis=0.0), initial_steps=1, **EXACT)
    slot.update(drafts)
    assert slot.current_steps == expected


def test_up_hysteresis_raises_the_upshift_threshold() -> None:
    slot = StepSlot(SlotConfig((1, 3), up_hysteresis=0.5), initial_steps=1, **EXACT)
    assert not slot.update([1, 1]) and slot.current_steps == 1  # 1.0 is not > 0.5 + 0.5
    slot = StepSlot(SlotConfig((1, 3), up_hysteresis=0.5), initial_steps=1, **EXACT)
    assert slot.update([1, 1, 1, 2]) and slot.current_steps == 3  # 1.25 > 1.0


def test_steps_zero_freezes_the_ema_and_probes_up() -> None:
    slot = StepSlot(SlotConfig((0, 3)), initial_steps=0)  # default settings
    for _ in range(19):
        assert not slot.update([5, 5])  # whatever is fed at steps 0 is not acceptance
    assert slot.ema == -1.0 and slot.batches == 19
    assert slot.update([0, 0]) and slot.current_steps == 3
    assert slot.ema == 2.0  # never measured: reseeded to target - 1
    # A measured EMA is kept when probing again.
    slot = StepSlot(SlotConfig((0, 1, 3), down_hysteresis=0.0), initial_steps=1, **EXACT)
    slot.update([0, 1, 0, 0])  # 0.25 -> drop to 0
    assert slot.current_steps == 0 and slot.ema == 0.25
    assert slot.update([7]) and slot.current_steps == 1 and slot.ema == 0.25


def test_a_slot_with_only_plain_decoding_never_switches() -> None:
    slot = StepSlot(SlotConfig((0,)), initial_steps=3)
    assert slot.current_steps == 0
    assert drive(slot, lambda n, s: [0], 500) == []


def test_probing_from_zero_backs_off_when_it_keeps_failing() -> None:
    slot = StepSlot(SlotConfig((0, 1, 3), down_hysteresis=0.0), initial_steps=3)  # defaults
    events = drive(slot, lambda n, s: [0] * 8, 1200)
    # 3 -> 0 at the first confirmed decision; each probe to 1 sees nothing accepted and drops back
    # (a failed upshift), and the wait before the next probe doubles: 64, 128, 256, 512 batches
    # after the drop, then the first confirmed decision (two grid points) once it is over.
    assert events == [(20, 0), (45, 1), (70, 0), (140, 1), (165, 0), (300, 1), (325, 0),
                      (590, 1), (615, 0), (1135, 1), (1160, 0)]
    assert slot.failed_upshifts == 5
    assert slot.upshift_blocked_until(0) == 1160 + 1024  # capped at upshift_backoff_max


def test_shadow_acceptance_at_zero_replaces_blind_probes() -> None:
    """At steps 0 the draft's catch-up reports how often its first draft would have been accepted:
    while those reports keep coming, no blind probe; they move the EMA, and enough of them above
    SHADOW_UPSHIFT (+ up_hysteresis) step up. When they stop, blind probing resumes."""
    slot = StepSlot(SlotConfig((0, 1, 3), down_hysteresis=0.0), initial_steps=3)  # default settings
    switches = []
    for n in range(1, 401):
        if slot.current_steps == 0 and n % 16 == 0:
            slot.observe_shadow([0.0, 0.1])  # a catch-up every 16 batches: drafts would fail
        if slot.update([0] * 2):
            switches.append((n, slot.current_steps))
    assert switches == [(20, 0)] and slot.failed_upshifts == 0  # the blind rule probed at 45
    assert 0 <= slot.ema < SHADOW_UPSHIFT
    for _ in range(30):  # the traffic turned: 90% of first drafts would be accepted
        slot.observe_shadow([0.9])
    assert slot.ema > SHADOW_UPSHIFT
    ups = [slot.update([1] * 2 if slot.current_steps else [0] * 2) for _ in range(10)]
    assert any(ups) and slot.current_steps == 1  # up at the next confirmed decisions
    assert slot.ema > SHADOW_UPSHIFT  # the shadow estimate carried into the measured EMA
    # Reports stop (no catch-up, e.g. an eager batch): after SHADOW_FRESH batches it probes blind.
    quiet = StepSlot(SlotConfig((0, 1)), initial_steps=0, **EXACT)
    quiet.observe_shadow([0.0])
    assert [quiet.update([0]) for _ in range(SHADOW_FRESH)] == [False] * SHADOW_FRESH
    assert quiet.update([0]) and quiet.current_steps == 1
    # Shadow reports at steps > 0 are ignored: real verifies measure there.
    busy = StepSlot(SlotConfig((0, 1)), initial_steps=1, **EXACT)
    busy.observe_shadow([1.0])
    assert busy.ema == 0.0


@pytest.mark.parametrize("coeff,start,drafts,expected", [
    (1.0, 7, [2, 3], 3),  # the walk stops at 5; ceiling ceil(2.5) = 3 caps it
    (0.0, 7, [2, 3], 5),  # off: the walk alone
    (0.5, 3, [2, 3, 3, 3, 3], 5),  # ceiling 2 but an upshift (2.8 > 2.5) is never capped
    (0.5, 5, [3, 3], 1),  # no move by the EMA, but 5 > ceiling ceil(1.5) = 2: down to 1
    (2.0, 5, [3, 3], 5),  # ceiling 6 >= 5: no cap
])
def test_ceiling_caps_only_targets_that_are_not_upshifts(coeff: float, start: int,
                                                         drafts: list[int], expected: int) -> None:
    slot = StepSlot(SlotConfig((1, 3, 5, 7), ceiling_coeff=coeff), initial_steps=start, **EXACT)
    slot.update(drafts)
    assert slot.current_steps == expected


def test_ceiling_below_every_candidate_keeps_the_smallest() -> None:
    slot = StepSlot(SlotConfig((3, 5), ceiling_coeff=0.1), initial_steps=5, **EXACT)
    assert slot.update([3, 3]) and slot.current_steps == 3  # ceiling max(1, ceil(0.3)) = 1


# ---------------------------------------------------------------- anti-flapping -------------

def test_min_dwell_holds_a_switch() -> None:
    slot = StepSlot(SlotConfig((1, 3)), initial_steps=1, ema_alpha=1.0, warmup_batches=0,
                    update_interval=1, min_dwell=6, upshift_backoff=0, confirm_decisions=1)
    # Up at 1 (1.0 > 0.5), then every batch says "drop" (0 <= 0.25): held until batch 1 + 6.
    assert drive(slot, lambda n, s: [1] if n == 1 else [0], 10) == [(1, 3), (7, 1)]


def test_a_switch_needs_consecutive_decisions_that_agree() -> None:
    slot = StepSlot(SlotConfig((1, 3, 5)), initial_steps=3, ema_alpha=1.0, warmup_batches=0,
                    update_interval=1, min_dwell=0, upshift_backoff=0, confirm_decisions=3)
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

    slot = StepSlot(SlotConfig((3, 5)), initial_steps=3, ema_alpha=1.0, warmup_batches=0,
                    update_interval=1, min_dwell=2, upshift_backoff=8, upshift_backoff_max=32,
                    confirm_decisions=1)
    events = drive(slot, feed, 300)
    # up at 1, back at 3 (dwell 2): failure 1 -> no upshift before 3 + 8 = 11; failure 2 -> 13 + 16;
    # failure 3 -> 31 + 32; failure 4 -> capped at 32.
    assert events[:10] == [(1, 5), (3, 3), (11, 5), (13, 3), (29, 5), (31, 3), (63, 5), (65, 3),
                           (97, 5), (99, 3)]
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

    slot2 = StepSlot(SlotConfig((3, 5)), initial_steps=3, ema_alpha=1.0, warmup_batches=0,
                     update_interval=1, min_dwell=2, upshift_backoff=8, upshift_backoff_max=32,
                    confirm_decisions=1)
    # Two failures (backoffs 8, 16); the upshift at 29 holds past 29 + 6; the drop at 41 is not a
    # failure; the next failed upshift (43 -> 45) waits 8 again, not 32; then 16.
    assert drive(slot2, feed2, 60) == [(1, 5), (3, 3), (11, 5), (13, 3), (29, 5), (41, 3), (43, 5),
                                       (45, 3), (53, 5), (55, 3)]
    assert slot2.failed_upshifts == 4 and slot2.upshift_blocked_until(3) == 55 + 16


def test_backoff_is_per_level_and_never_blocks_downshifts() -> None:
    slot = StepSlot(SlotConfig((1, 3, 5)), initial_steps=3, ema_alpha=1.0, warmup_batches=0,
                    update_interval=1, min_dwell=0, upshift_backoff=50,
                    confirm_decisions=1)
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
    assert drive(ours, feed, 3000) == [(20, 5), (45, 3), (110, 5), (135, 3), (270, 5), (295, 3),
                                       (560, 5), (585, 3), (1100, 5), (1125, 3), (2150, 5), (2175, 3)]
    assert ours.failed_upshifts == 6 and ours.upshift_blocked_until(3) == 2175 + 1024


@pytest.mark.parametrize("p", [0.8, 0.85, 0.9])
def test_noisy_acceptance_switches_far_less_at_about_the_same_yield(p: float) -> None:
    # Batch size 1, each draft accepted with probability p: the EMA is noisy and the 3/5 and 5/7
    # boundaries are crossed by chance. Tokens per cost (1 + 0.15 per step) stays close.
    cfg = SlotConfig((1, 3, 5, 7))
    plain_sw = ours_sw = 0
    plain_yield, ours_yield = [], []
    for seed in range(4):
        for policy, sink, yields in ((PlainEmaRule(cfg, initial=3), "plain", plain_yield),
                                     (StepSlot(cfg, initial_steps=3), "ours", ours_yield)):
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


@pytest.mark.parametrize("cands,down_h,up_h,coeff", [
    ((1, 3, 5, 7), -0.25, 0.0, 0.0), ((0, 1, 3), 0.0, 0.0, 0.0), ((0, 2, 4, 6), -0.3, 0.2, 1.5),
])
def test_without_anti_flapping_it_is_the_plain_rule_stepping_up_one_at_a_time(
        cands: tuple[int, ...], down_h: float, up_h: float, coeff: float) -> None:
    cfg = SlotConfig(cands, up_hysteresis=up_h, down_hysteresis=down_h, ceiling_coeff=coeff)
    for seed in range(3):
        rng = random.Random(seed)
        ours = StepSlot(cfg, initial_steps=cands[1], min_dwell=0, upshift_backoff=0,
                        confirm_decisions=1)
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
