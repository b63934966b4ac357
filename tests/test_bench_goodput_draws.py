"""The goodput bench's second draws (bench/gpu/goodput_plan.py `redraw`, goodput_run.py): which
rates are drawn again, and a point's figures over every draw's requests."""

from __future__ import annotations

import pytest

from bench.gpu import goodput_plan as plan
from bench.gpu.goodput_report import Results, point_entries
from bench.gpu.goodput_run import draw_summary
from loadgen.metrics import RequestRecord

LOOSE, TIGHT = {"ttft": 0.5, "tpot": 0.025}, {"ttft": 0.25, "tpot": 0.015}


def _with_redraws(ladder: plan.Ladder, draws: dict[float, list[tuple[float, float]]]) -> list[tuple[float, int]]:
    """Run ladder and redraws as the bench does: `draws[rate]` gives each draw's (loose, tight)
    attainment over 100 requests (a rate not listed holds both SLOs below 32 req/s and misses both
    from there); returns (rate, draw) in order."""
    done: dict[float, plan.Measured] = {}
    sums: dict[float, list[float]] = {}
    order: list[tuple[float, int]] = []
    redrawn = 0
    while True:
        again = plan.redraw(ladder, list(done.values()), redrawn)
        rate = again if again is not None else plan.next_rate(ladder, list(done.values()))
        if rate is None:
            return order
        draw = done[rate].draws if rate in done else 0
        redrawn += bool(draw)
        held = 1.0 if rate < 32 else 0.0
        loose, tight = draws.get(rate, [(held, held)] * plan.MAX_DRAWS)[draw]
        total = sums.setdefault(rate, [0.0, 0.0])
        total[0], total[1] = total[0] + loose, total[1] + tight
        done[rate] = plan.Measured(rate, total[0] / (draw + 1), total[1] / (draw + 1), draw + 1)
        order.append((rate, draw))


def test_a_doubtful_or_out_of_order_rate_is_drawn_again_before_the_ladder_moves_on() -> None:
    ladder = plan.Ladder(max_points=8, resolution=1.1)
    # colocated decode_heavy tight in the twenty-fourth run: 15% at 22.6, 100% at 26.9
    curve = {
        32.0: [(0.4, 0.07)] * 2,
        22.6: [(1.0, 0.15), (1.0, 0.95)],
        26.9: [(1.0, 1.0), (1.0, 0.2)],
        29.3: [(1.0, 0.35)] * 2,
        24.7: [(1.0, 0.3)] * 2,
        19.0: [(1.0, 0.89), (1.0, 0.97)],  # doubtful, then met
    }
    order = _with_redraws(ladder, curve)
    first = {rate: i for i, (rate, draw) in reversed(list(enumerate(order))) if draw == 0}
    again = [(rate, i) for i, (rate, draw) in enumerate(order) if draw == 1]
    assert len(again) <= ladder.max_redraws and len(set(order)) == len(order)  # at most two draws a rate
    # 26.9 met above 22.6's miss: both drawn again, the lower (quicker) first, before any new rate
    assert [rate for rate, _ in again[:2]] == [22.6, 26.9]
    assert again[0][1] == first[26.9] + 1 and again[1][1] == again[0][1] + 1
    # no draws without doubt
    assert all(draw == 0 for _, draw in _with_redraws(ladder, {}))


def test_redraws_stop_at_the_curves_allowance() -> None:
    ladder = plan.Ladder(max_redraws=1)
    m = [plan.Measured(8, 0.9, 0.9), plan.Measured(16, 0.88, 0.88), plan.Measured(32, 0.2, 0.2)]
    assert plan.redraw(ladder, m, redrawn=0) == 8  # 90%: two requests from missing
    assert plan.redraw(ladder, m, redrawn=1) is None
    assert plan.redraw(ladder, [plan.Measured(8, 0.9, 0.9, draws=2), m[2]], redrawn=0) is None


def _records(within: int, total: int) -> list[RequestRecord]:
    """`total` requests of 11 tokens, the first `within` inside both SLOs, the rest over the TTFT limits."""
    out = []
    for i in range(total):
        ttft = 0.05 if i < within else 0.8
        e2e = ttft + 10 * 0.005
        out.append(RequestRecord(i, 8, 11, ttft=ttft, chunk_times=[ttft, e2e], e2e=e2e, output_tokens=11))
    return out


def test_a_second_draw_makes_the_point_one_over_both_draws_requests() -> None:
    slos = {"loose": LOOSE, "tight": TIGHT}
    results = Results({"device": "cpu", "slos": slos})
    results.workload("w", {"description": "test"})
    first, second = _records(15, 100), _records(95, 100)
    alone = point_entries("colocated", 22.6, first, 6.0, slos)
    results.add_point("w", alone, paths={"colocated": 100.0}, draws=[draw_summary(1, alone, {})])
    both = point_entries("colocated", 22.6, first + second, 12.5, slos)
    results.merge_draw(
        "w", "colocated", 22.6, both, draw_summary(2, point_entries("colocated", 22.6, second, 6.5, slos), {})
    )
    for slo in ("loose", "tight"):
        (point,) = results.data["workloads"]["w"][slo]["points"]
        assert point["attainment"] == pytest.approx(0.55) and point["requests"] == 200
        assert point["duration_s"] == 12.5 and point["paths"] == {"colocated": 100.0}  # the first draw's signals
        assert [d["seed"] for d in point["draws"]] == [1, 2]
        assert [d["attainment"][slo] for d in point["draws"]] == [pytest.approx(0.15), pytest.approx(0.95)]
    data = results.finish()
    assert data["workloads"]["w"]["tight"]["colocated_goodput"] is None  # 55% over both draws
    # each draw alone: the first missed at 22.6, the second met it
    assert data["workloads"]["w"]["tight"]["colocated_goodput_by_draw"] == [None, 22.6]


def test_goodput_by_draw_reads_each_draw_of_every_rate() -> None:
    from bench.gpu.goodput_report import goodput_by_draw

    def point(rate: float, *attained: float) -> dict:
        return {"rate": rate, "draws": [{"attainment": {"tight": a}} for a in attained]}

    points = [point(19.0, 1.0, 0.97), point(20.7, 0.92, 0.85), point(22.6, 0.5)]  # 22.6 drawn once
    assert goodput_by_draw(points, "tight") == [20.7, 19.0]
    assert goodput_by_draw([point(16.0, 0.4)], "loose") == [None]  # a draw not judged by that SLO
    assert goodput_by_draw([{"rate": 4.0}], "tight") == []  # a point from before draws were recorded
