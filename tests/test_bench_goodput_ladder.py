"""The goodput bench's adaptive rate ladder (bench/gpu/goodput_plan.py) against synthetic curves."""

from __future__ import annotations

from bench.gpu import goodput_plan as plan
from loadgen.metrics import goodput


def _sweep(ladder: plan.Ladder, knee_loose: float, knee_tight: float) -> list[plan.Measured]:
    """Run the ladder against curves that hold up to their knee and fall fast after it."""

    def attained(rate: float, knee: float) -> float:
        return 1.0 if rate <= knee else max(0.0, 1.0 - 3.0 * (rate - knee) / knee)

    done: list[plan.Measured] = []
    while (rate := plan.next_rate(ladder, done)) is not None:
        done.append(plan.Measured(rate, attained(rate, knee_loose), attained(rate, knee_tight)))
    return done


def test_the_ladder_climbs_past_the_knee_then_sharpens_both_slos() -> None:
    done = _sweep(plan.Ladder(), knee_loose=20, knee_tight=8)
    # x2 while every rate holds; 32 is well below; the brackets (8, 16) tight and (16, 32) loose are
    # as wide: the tight one first (the quicker point, and the knee a run out of time most needs)
    assert [m.rate for m in done] == [4, 8, 16, 32, 11.3, 22.6]
    assert goodput((m.rate, m.loose) for m in done) == 16 and goodput((m.rate, m.tight) for m in done) == 8


def test_the_ladder_goes_down_when_the_first_rate_misses_and_ends_past_two_misses() -> None:
    done = _sweep(plan.Ladder(max_points=20), knee_loose=3, knee_tight=1)
    rates = [m.rate for m in done]
    assert rates[:2] == [4, 2] and len(set(rates)) == len(rates)
    above = [m for m in done if m.rate > goodput((m.rate, m.loose) for m in done)]
    assert len(above) >= 2 and any(m.loose < 0.6 for m in above)  # past the knee, well below once
    lo, hi = 2.83, min(m.rate for m in above)
    assert goodput((m.rate, m.loose) for m in done) == lo and hi / lo <= plan.Ladder().resolution


def test_the_ladder_stops_at_its_limits() -> None:
    assert [m.rate for m in _sweep(plan.Ladder(), knee_loose=0.1, knee_tight=0.1)] == [4, 2, 1, 0.5]
    assert len(_sweep(plan.Ladder(max_points=3), 20, 8)) == 3
    capped = _sweep(plan.Ladder(max_rate=50), knee_loose=1000, knee_tight=1000)
    assert [m.rate for m in capped] == [4, 8, 16, 32, 50]  # never past max_rate, nothing to sharpen
    assert plan.next_rate(plan.Ladder(start=3), []) == 3


def _bracket(done: list[plan.Measured], slo: str) -> float:
    """The ratio of a curve's lowest missing rate to its highest meeting one, under `slo`."""
    met = max(m.rate for m in done if getattr(m, slo) >= 0.9)
    return min(m.rate for m in done if m.rate > met) / met


def test_a_curve_judged_by_both_slos_gets_the_points_to_sharpen_both_knees() -> None:
    ladder = plan.Ladder(max_points=8, resolution=1.1)
    assert plan.curve_ladder(ladder, both_slos=False) == ladder
    both = plan.curve_ladder(ladder, both_slos=True)
    assert both.max_points == 8 + plan.BOTH_SLOS_EXTRA_POINTS
    # chat_mix-like knees: at 8 points the tight bracket stayed open at ~1.4x
    short, full = _sweep(ladder, knee_loose=95, knee_tight=38), _sweep(both, knee_loose=95, knee_tight=38)
    assert _bracket(short, "tight") > 1.3 and _bracket(full, "tight") < _bracket(short, "tight")
    assert [m.rate for m in full[: len(short)]] == [m.rate for m in short]  # the same first points
