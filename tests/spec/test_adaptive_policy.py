"""Adaptive-steps slots: EMA and hysteresis on scripted acceptance, and shadow scores (anti-flapping:
tests/spec/test_adaptive_anti_flapping.py; the controller over the slots: test_adaptive_controller.py)."""

from __future__ import annotations

import pytest

from spec.adaptive import AdaptiveConfigError, SlotConfig, StepSlot
from spec.adaptive.slot import SHADOW_FRESH, SHADOW_UPSHIFT
from tests.spec.adaptive_kit import EXACT, PlainEmaRule, drive

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
    slot = StepSlot(
        SlotConfig((1, 3)),
        initial_steps=1,
        ema_alpha=1.0,
        warmup_batches=3,
        update_interval=4,
        min_dwell=0,
        confirm_decisions=1,
    )
    assert drive(slot, lambda n, s: [0] if n < 8 else [1], 30) == [(11, 3)]  # grid: 7, 11, 15...


@pytest.mark.parametrize(
    "start,drafts,expected",
    [
        (3, [2, 3], 3),  # ema 2.5 == 3 - 0.5 + up_h: equality does not upshift
        (3, [2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2], 5),  # 2.5 + 1/12 > 2.5: up
        (5, [2, 2, 2, 3], 3),  # ema 2.25 == 3 - 0.5 - 0.25: equality downshifts
        (5, [2, 2, 3, 3, 2, 2, 2, 3], 5),  # 2.375: above the drop threshold, stays
        (7, [0, 0, 0, 1], 1),  # 0.25: at or below 4.25, 2.25 and 0.25: three levels at once
        (7, [0, 1], 3),  # 0.5: below 4.25 and 2.25, above 0.25
    ],
)
def test_thresholds_exactly(start: int, drafts: list[int], expected: int) -> None:
    slot = StepSlot(SlotConfig((1, 3, 5, 7), up_hysteresis=0.0, down_hysteresis=-0.25), initial_steps=start, **EXACT)
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
    assert events == [
        (20, 0),
        (45, 1),
        (70, 0),
        (140, 1),
        (165, 0),
        (300, 1),
        (325, 0),
        (590, 1),
        (615, 0),
        (1135, 1),
        (1160, 0),
    ]
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


@pytest.mark.parametrize(
    "coeff,start,drafts,expected",
    [
        (1.0, 7, [2, 3], 3),  # the walk stops at 5; ceiling ceil(2.5) = 3 caps it
        (0.0, 7, [2, 3], 5),  # off: the walk alone
        (0.5, 3, [2, 3, 3, 3, 3], 5),  # ceiling 2 but an upshift (2.8 > 2.5) is never capped
        (0.5, 5, [3, 3], 1),  # no move by the EMA, but 5 > ceiling ceil(1.5) = 2: down to 1
        (2.0, 5, [3, 3], 5),  # ceiling 6 >= 5: no cap
    ],
)
def test_ceiling_caps_only_targets_that_are_not_upshifts(
    coeff: float, start: int, drafts: list[int], expected: int
) -> None:
    slot = StepSlot(SlotConfig((1, 3, 5, 7), ceiling_coeff=coeff), initial_steps=start, **EXACT)
    slot.update(drafts)
    assert slot.current_steps == expected


def test_ceiling_below_every_candidate_keeps_the_smallest() -> None:
    slot = StepSlot(SlotConfig((3, 5), ceiling_coeff=0.1), initial_steps=5, **EXACT)
    assert slot.update([3, 3]) and slot.current_steps == 3  # ceiling max(1, ceil(0.3)) = 1
