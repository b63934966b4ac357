"""The goodput bench measured around an earlier run's knees (`--around`; bench/gpu/goodput_plan.py
`Focus`, `focused_next`): which rungs, how many draws, when it reaches further, and how a curve
finds its knees in the earlier report."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from bench.gpu import goodput_plan as plan
from bench.gpu.goodput_report import prior_knees
from bench.gpu.goodput_run import curve_focus, next_rate
from bench.gpu.goodput_settings import parse_args, run_settings


def _sweep(focus: plan.Focus, slos: list[str], held: Callable[[float], tuple[float, float]]) -> list[tuple[float, int]]:
    """(rate, draw) in the order a focused curve measures them, `held(rate)` giving each draw's
    (loose, tight) attainment."""
    ladder = plan.Ladder(max_points=8, resolution=1.1)
    done: dict[float, plan.Measured] = {}
    order: list[tuple[float, int]] = []
    while (rate := next_rate(ladder, focus, list(done.values()), 0, slos[0] if len(slos) == 1 else None)) is not None:
        draw = done[rate].draws if rate in done else 0
        loose, tight = held(rate)
        done[rate] = plan.Measured(rate, loose, tight, draw + 1)
        order.append((rate, draw))
        assert len(order) < 40, order
    return order


def test_a_focused_curve_draws_the_rungs_next_to_its_knee_and_stops() -> None:
    """The twenty-fifth run's PD decode_heavy tight knee (20.7 req/s): 18.8, 20.7 and 22.8 once,
    lowest first; they bracket the knee, so nothing further, and the second draws go to the
    bracket first, its miss before its met rate."""
    focus = plan.Focus((20.7,), step=1.1, draws=2)
    order = _sweep(focus, ["tight"], lambda r: (1.0, 1.0 if r < 21 else 0.5))
    assert order == [(18.8, 0), (20.7, 0), (22.8, 0), (22.8, 1), (20.7, 1), (18.8, 1)]


def test_a_focused_curve_reaches_for_its_knee_before_it_repeats_a_rung() -> None:
    """The twenty-seventh run's PD chat_mix tight: focused on 32 req/s, every rung met, and the
    curve ran out of time after drawing 29.1, 32 and 35.2 twice (a lower bound). Now the rungs
    above come before any second draw."""
    focus = plan.Focus((32.0,), step=1.1, draws=2)
    order = _sweep(focus, ["tight"], lambda r: (1.0, 1.0 if r < 41 else 0.4))
    assert order[:5] == [(29.1, 0), (32.0, 0), (35.2, 0), (38.7, 0), (42.6, 0)]
    assert [r for r, _ in order[5:]] == [42.6, 38.7, 35.2, 32.0, 29.1]  # repeats: the bracket first


def test_a_focused_curve_reaches_further_where_its_rungs_miss_the_knee() -> None:
    """A knee that moved up since: a rung above the highest, drawn twice, until one misses; one that
    moved down: a rung below the lowest."""
    focus = plan.Focus((20.7,), step=1.1, draws=2)
    up = _sweep(focus, ["loose"], lambda r: (1.0 if r < 26 else 0.3, 0.0))
    assert [r for r, d in up if d == 0] == [18.8, 20.7, 22.8, 25.1, 27.6]
    down = _sweep(focus, ["loose"], lambda r: (1.0 if r < 17.5 else 0.3, 0.0))
    assert [r for r, d in down if d == 0] == [18.8, 20.7, 22.8, 17.1]
    assert all(sum(1 for r, _ in down if r == rate) == 2 for rate, _ in down)


def test_a_knee_that_moved_between_the_earlier_knees_is_bisected_to_a_rung() -> None:
    """The twenty-sixth run's colocated decode_heavy: focused on 38.1 (loose) and 20.7 (tight), its
    loose curve met at 22.8 and missed from 34.6 on. The gap between is halved until a rung apart:
    28.1 (met), then 31.2 (missed)."""
    focus = plan.Focus((38.1, 20.7), step=1.1, draws=2)
    order = _sweep(focus, ["loose", "tight"], lambda r: (1.0 if r < 30 else 0.5, 1.0 if r < 21 else 0.0))
    assert [r for r, d in order if d == 0] == [18.8, 20.7, 22.8, 34.6, 38.1, 41.9, 28.1, 31.2]
    assert len(order) == 16  # every rate twice


def test_a_curve_judged_by_both_slos_is_focused_on_both_knees() -> None:
    focus = plan.Focus((20.7, 17.4), step=1.1, draws=1)
    order = _sweep(focus, ["loose", "tight"], lambda r: (1.0 if r < 21 else 0.0, 1.0 if r < 18 else 0.0))
    assert [r for r, _ in order] == [15.8, 17.4, 18.8, 19.1, 20.7, 22.8]


def _prior(tmp_path: Path) -> Path:
    report = {
        "slos": {"loose": {"ttft_ms": 500.0, "tpot_ms": 25.0}, "tight": {"ttft_ms": 250.0, "tpot_ms": 15.0}},
        "command": "python -m bench.gpu.goodput --out OUT",
        "workloads": {
            "decode_heavy": {
                "loose": {"pd_pooled_goodput": 38.1, "colocated_goodput": 38.1},
                "tight": {"pd_pooled_goodput": 20.7, "colocated_goodput": None},
            }
        },
    }
    path = tmp_path / "prior.json"
    path.write_text(json.dumps(report))
    return path


def test_each_curve_takes_its_own_knees_from_the_earlier_report(tmp_path: Path) -> None:
    prior = _prior(tmp_path)
    args = parse_args(["--around", str(prior), "--focus-draws", "3"])
    settings, _ = run_settings(args, "llama8b")
    assert settings.focus.draws == 3 and settings.focus.step == pytest.approx(1.1)
    assert curve_focus(settings, "decode_heavy", "pd_pooled", "tight") == replace(settings.focus, knees=(20.7,))
    assert curve_focus(settings, "decode_heavy", "pd_pooled", None) == replace(settings.focus, knees=(38.1, 20.7))
    # colocated found no tight knee there: its curve is focused on the loose one alone
    assert curve_focus(settings, "decode_heavy", "colocated", None) == replace(settings.focus, knees=(38.1,))
    # no knee at all (a workload the earlier run did not measure): the ladder from its start
    assert curve_focus(settings, "chat_mix", "colocated", None) is None
    assert prior_knees({}, "chat_mix", "pd", ["loose"]) == ()
    plain, _ = run_settings(parse_args([]), "llama8b")
    assert curve_focus(plain, "decode_heavy", "pd_pooled", "tight") is None
    # a deployment the earlier run did not measure, around a like one's knees (--around-from)
    assert curve_focus(settings, "decode_heavy", "pd_always_pooled", "tight") is None
    like, _ = run_settings(parse_args(["--around", str(prior), "--around-from", "pd,colocated,pd_pooled"]), "llama8b")
    assert like.around_from == ("pd", "colocated", "pd_pooled")
    always = "pd_always_pooled"
    assert curve_focus(like, "decode_heavy", always, "loose") == replace(like.focus, knees=(38.1,), of="colocated")
    assert curve_focus(like, "decode_heavy", always, "tight") == replace(like.focus, knees=(20.7,), of="pd_pooled")
    own = curve_focus(like, "decode_heavy", "pd_pooled", "tight")
    assert own == replace(like.focus, knees=(20.7,))  # its own knees first
    with pytest.raises(SystemExit, match="--around-from"):
        run_settings(parse_args(["--around", str(prior), "--around-from", "colocatd"]), "llama8b")


def test_an_earlier_report_under_other_slos_or_nonsense_rungs_are_refused(tmp_path: Path) -> None:
    prior = _prior(tmp_path)
    with pytest.raises(SystemExit, match="SLOs differ"):
        run_settings(parse_args(["--around", str(prior), "--slo-tight", "ttft=200ms,tpot=15ms"]), "llama8b")
    with pytest.raises(SystemExit, match="--focus-draws"):
        run_settings(parse_args(["--around", str(prior), "--focus-draws", "0"]), "llama8b")
    with pytest.raises(SystemExit, match="--around"):
        run_settings(parse_args(["--around", str(tmp_path / "missing.json")]), "llama8b")
