"""Planning the goodput sweep (pure): the adaptive ladder of Poisson rates, requests per rate, when
a request can no longer meet the SLO, and each curve's share of the time budget.

The ladder picks each curve's next rate from the attainments measured so far, in this order:
1. until some rate meets the loose SLO's target (90%), halve below the lowest rate tried;
2. while every rate so far met it, climb x`climb` from the highest rate tried;
3. sharpen: the geometric middle of the widest bracket (highest rate meeting the target, lowest
   rate above it) of either SLO while it is wider than `resolution`, the tight SLO's on a tie (its
   middle is the lower rate, the quicker point to run, and a run out of time keeps the tight knee
   found); the tight SLO, whose knee is lower, may first need a rate below the lowest tried.
   This comes before going further past the knee: the goodput is what the brackets decide, and a
   run short of time (a two-GPU run of 215 s probed 64 and then 83 req/s, leaving 32-64 open)
   should spend it there;
4. until a rate above the highest one meeting the target is well below it, climb x`past_knee`
   from the highest rate tried (overloaded points are the slowest to run, so it steps gently);
   if only one rate has missed above the highest that met it, climb once more: the curve ends
   after two rates past its knee (one of them well below the target), so a single bad point
   does not end it.
The loose SLO drives steps 1, 2 and 4: every request within the tight SLO is within the loose one,
so past the loose knee the tight curve is too. A curve ends at `max_points` or when nothing is left.

Before the ladder moves on, a rate whose one Poisson draw cannot be trusted is drawn again (`redraw`,
at most `max_redraws` a curve): one within a few points of the target, or one that breaks the
curve's order (a rate that missed below one that met, under either SLO); its attainment is then
over both draws' requests.

A curve may instead be measured around the knees an earlier run found (`Focus`, `focused_next`):
the rungs next to each knee once, then one rung further down or up for an SLO those rungs did
not bracket, or the middle of a gap wider than a rung where the knee fell between two earlier
knees, and last each rate's further draws, the knee's bracket first. No point is spent far below
a knee, and a curve out of time has reached for its knee before it repeated a rung.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from loadgen.metrics import GOODPUT_MIN_ATTAINMENT


@dataclass(frozen=True)
class Measured:
    """One swept rate's attainment under each SLO."""

    rate: float
    loose: float
    tight: float
    draws: int = 1  # Poisson draws at this rate; the attainments are over all of their requests


@dataclass(frozen=True)
class Ladder:
    start: float = 4.0  # requests/s
    climb: float = 2.0
    past_knee: float = 1.3
    target: float = GOODPUT_MIN_ATTAINMENT
    well_below: float = 0.6  # "well below the target": the curve has passed its knee here
    min_rate: float = 0.5
    max_rate: float = 512.0
    max_points: int = 6
    resolution: float = 1.25  # a bracket whose ends are closer than this ratio is left as it is
    # Second draws per curve. One draw decided tight ratios: colocated's decode_heavy tight curve
    # read 15% at 22.6 req/s, 100% at 26.9 and 35% at 29.3, and its goodput 16 and 26.9 req/s in
    # two runs; PD's read 89% at 22.6 (bench/RESULTS.md, the twenty-fourth run).
    max_redraws: int = 3
    doubtful_from: float = 0.85  # attainments from here...
    doubtful_to: float = 0.95  # ...to below here get a second draw


MAX_DRAWS = 2  # draws of one rate


# A curve judged by both SLOs sharpens two knees with the points a curve judged by one spends on
# one: at 8 points, colocated's chat_mix curve left its tight bracket at 32-45.3 req/s while PD's
# tight-only curve reached 41.5, a 1.297x ratio no point of colocated's could confirm
# (bench/RESULTS.md, twenty-third run).
BOTH_SLOS_EXTRA_POINTS = 2


def curve_ladder(ladder: Ladder, both_slos: bool) -> Ladder:
    """The ladder of one curve: `BOTH_SLOS_EXTRA_POINTS` more points when both SLOs judge it."""
    if not both_slos:
        return ladder
    return replace(ladder, max_points=ladder.max_points + BOTH_SLOS_EXTRA_POINTS)


def _round(rate: float) -> float:
    return float(f"{rate:.3g}")  # readable rates; a repeat of a tried one is then caught exactly


def next_rate(ladder: Ladder, done: Sequence[Measured]) -> float | None:
    """The next rate to measure on this curve, or None when it is finished."""
    if len(done) >= ladder.max_points:
        return None
    if not done:
        return ladder.start
    tried = {m.rate for m in done}
    down = _round(min(tried) / ladder.climb)
    can_go_down = down >= ladder.min_rate and down not in tried
    loose = {m.rate: m.loose for m in done}
    met = [r for r, a in loose.items() if a >= ladder.target]
    if not met:  # step 1 (None: missed even at the lowest rate allowed)
        return down if can_go_down else None
    above = [r for r in loose if r > max(met)]  # every one of them missed
    factor = ladder.past_knee if any(a < ladder.target for a in loose.values()) else ladder.climb
    up = _round(min(ladder.max_rate, max(tried) * factor))
    can_go_up = max(tried) < ladder.max_rate and up not in tried
    if can_go_up and not above:
        return up  # step 2: every rate so far met the target
    sharper = _sharpen(ladder, done, down if can_go_down else None)
    if sharper is not None:
        return sharper  # step 3, before going further past the knee (the goodput first)
    if can_go_up and not any(loose[r] < ladder.well_below for r in above):
        return up  # step 2: not well past the knee yet
    return up if can_go_up and len(above) < 2 else None  # a second miss past the knee


def redraw(ladder: Ladder, done: Sequence[Measured], redrawn: int) -> float | None:
    """The rate to draw again before the ladder moves on (the lowest such: the quickest point), or
    None: none left with a single draw that is doubtful or out of order, or `redrawn` (this curve's
    second draws so far) at `max_redraws`."""
    if redrawn >= ladder.max_redraws:
        return None
    lo, hi = ladder.doubtful_from, ladder.doubtful_to
    doubtful = set()
    for slo in ("loose", "tight"):
        attained = {m.rate: getattr(m, slo) for m in done}
        missed = [r for r, a in attained.items() if a < ladder.target]
        met = [r for r, a in attained.items() if a >= ladder.target]
        doubtful |= {r for r, a in attained.items() if lo <= a < hi}
        doubtful |= {r for r in missed if any(r < m for m in met)}  # out of order: both ends
        doubtful |= {m for m in met if any(r < m for r in missed)}
    once = [m.rate for m in done if m.draws < MAX_DRAWS and m.rate in doubtful]
    return min(once, default=None)


def _sharpen(ladder: Ladder, done: Sequence[Measured], down: float | None) -> float | None:
    """The geometric middle of the widest bracket wider than `resolution` (the tight SLO's first
    on a tie), or `down` for an SLO no rate has met yet."""
    tried = {m.rate for m in done}
    brackets: list[tuple[float, int, float]] = []  # (width, tight first, rate)
    for order, slo in enumerate(("loose", "tight")):
        attained = {m.rate: getattr(m, slo) for m in done}
        met = [r for r, a in attained.items() if a >= ladder.target]
        if not met:
            if down is not None:
                brackets.append((ladder.climb, order, down))
            continue
        lo = max(met)
        above = [r for r in attained if r > lo]
        if above and min(above) / lo > ladder.resolution:
            mid = _round(math.sqrt(lo * min(above)))
            if lo < mid < min(above) and mid not in tried:
                brackets.append((min(above) / lo, order, mid))
    return max(brackets)[2] if brackets else None


@dataclass(frozen=True)
class Focus:
    """A curve measured around the knees an earlier run found for it."""

    knees: tuple[float, ...]  # that run's goodput under each SLO judging this curve (req/s)
    of: str = ""  # the deployment those knees are of, where not this curve's own (--around-from)
    step: float = 1.1  # between rungs
    draws: int = 2  # Poisson draws of every rung
    span: int = 1  # rungs on each side of a knee


def focus_rates(focus: Focus) -> list[float]:
    """The rungs next to each knee, lowest first."""
    return sorted({_round(k * focus.step**i) for k in focus.knees for i in range(-focus.span, focus.span + 1)})


def focused_next(ladder: Ladder, focus: Focus, done: Sequence[Measured], slos: Sequence[str]) -> float | None:
    """The next rate of a focused curve (a repeat for a further draw), or None when every rung and
    extension has its draws. First one draw of each rung next to the knees; then, for an SLO in
    `slos` that no rate met, one rung below the lowest tried, for one that every rate met, one rung
    above the highest, and for one whose highest met rate and the next rate tried above it are more
    than a rung apart (a knee that moved between the earlier run's knees), their geometric middle;
    last the further draws, nearest the knee first. Reaching before repeating: a curve that runs out
    of time with every rung drawn twice but its knee unfound reports only a lower bound (three of
    six PD curves in the twenty-seventh run), while one out of time among its repeats lacks a draw
    of a rate below its knee."""
    by_rate = {m.rate: m for m in done}
    for rate in focus_rates(focus):
        if rate not in by_rate:
            return rate
    reach = _reach(ladder, focus, done, by_rate, slos)
    if reach is not None:
        return reach
    short = [m.rate for m in done if m.draws < focus.draws]
    if not short:
        return None
    brackets = _knee_brackets(done, ladder, slos)
    return min(short, key=lambda rate: (_from_brackets(rate, brackets), -rate))


def _reach(
    ladder: Ladder, focus: Focus, done: Sequence[Measured], by_rate: dict[float, Measured], slos: Sequence[str]
) -> float | None:
    """A rate past the rungs next to the knees (focused_next says which), or None."""
    if len(done) >= len(focus_rates(focus)) + FOCUS_EXTENSIONS * len(slos):
        return None
    for slo in slos:
        attained = {m.rate: getattr(m, slo) for m in done}
        met = [r for r, a in attained.items() if a >= ladder.target]
        down, up = _round(min(attained) / focus.step), _round(max(attained) * focus.step)
        if not met and down >= ladder.min_rate and down not in by_rate:
            return down
        if met and max(met) == max(attained) and up <= ladder.max_rate and up not in by_rate:
            return up
        if met and (mid := _focus_gap(attained, max(met), focus.step)) is not None and mid not in by_rate:
            return mid
    return None


def _knee_brackets(done: Sequence[Measured], ladder: Ladder, slos: Sequence[str]) -> list[tuple[float, float]]:
    """Each SLO's knee bracket: its highest met rate and the next rate tried above it (the lowest
    tried, alone, where none met)."""
    brackets = []
    for slo in slos:
        met = [m.rate for m in done if getattr(m, slo) >= ladder.target]
        lo = max(met) if met else min(m.rate for m in done)
        above = [m.rate for m in done if m.rate > lo]
        brackets.append((lo, min(above) if met and above else lo))
    return brackets


def _from_brackets(rate: float, brackets: Sequence[tuple[float, float]]) -> float:
    """How far `rate` lies from the nearest knee bracket, in log distance (0 inside one). Repeats
    go nearest first, the higher rate on a tie: a first draw was more often the bad one
    (twenty-sixth run), so a miss above the knee is the likeliest to turn."""
    return min(0.0 if lo <= rate <= hi else min(abs(math.log(rate / b)) for b in (lo, hi)) for lo, hi in brackets)


FOCUS_EXTENSIONS = 4  # rates past the knees' rungs per SLO: a step out, then halving a gap to a rung


def _focus_gap(attained: dict[float, float], lo: float, step: float) -> float | None:
    """The geometric middle between `lo` (the highest rate that met) and the next rate tried above
    it, where the two are more than a rung apart (rounding allowed for); None otherwise."""
    above = [r for r in attained if r > lo]
    if not above or min(above) / lo <= step * 1.01:
        return None
    mid = _round(math.sqrt(lo * min(above)))
    return mid if lo < mid < min(above) else None


def requests_at(rate: float, window_s: float, least: int, most: int) -> int:
    """Requests sent at `rate`: about `window_s` of Poisson arrivals, within [least, most]."""
    return max(least, min(most, math.ceil(rate * window_s)))


def cut_after_s(slo: dict[str, float], output_len: int) -> float:
    """Seconds after which a request of `output_len` tokens can no longer meet `slo` (seconds, with
    ttft and tpot): within both limits it ends by ttft + tpot * (output_len - 1). A tenth and a
    quarter second more, for the client's own timing."""
    return (slo["ttft"] + slo["tpot"] * max(0, output_len - 1)) * 1.1 + 0.25


def curve_deadline(now: float, deadline: float, curves_left: int, reserve_s: float) -> float:
    """When the next curve should end: an equal share of what the budget has left once `reserve_s`
    (the deployments still to start and stop) is set aside."""
    return now + max(0.0, deadline - now - reserve_s) / max(1, curves_left)


def point_estimate_s(n: int, rate: float, tail_s: float) -> float:
    """A point's expected wall time: its arrivals, then the last requests' tail."""
    return n / rate + tail_s


@dataclass
class Budget:
    """The run's time: each curve gets an equal share of what is left once the deployments still
    to start and stop (and the current one's stop) are set aside."""

    deadline: float  # time.monotonic() at which the whole run should be done
    curves_per_deployment: int
    deployments_left: int  # counting the one being measured
    start_s: float  # one deployment's start: a guess until one is measured
    stop_s: float  # and its stop
    curves_done_here: int = 0

    def started(self, start_s: float) -> None:
        self.start_s = start_s  # the next deployment loads the same model

    def curve_end(self, now: float) -> float:
        later = self.deployments_left - 1
        curves_left = later * self.curves_per_deployment + self.curves_per_deployment - self.curves_done_here
        reserve = later * (self.start_s + self.stop_s) + self.stop_s
        return curve_deadline(now, self.deadline, curves_left, reserve)

    def curve_done(self) -> None:
        self.curves_done_here += 1

    def deployment_done(self) -> None:
        self.deployments_left -= 1
        self.curves_done_here = 0
