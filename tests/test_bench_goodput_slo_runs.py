"""The goodput bench's per-SLO runs: a PD deployment set up for one SLO, judged by it alone."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.gpu import goodput_plan as plan
from bench.gpu.goodput import guard_for, parse_deployments, run_settings
from bench.gpu.goodput_report import Results, point_entries
from bench.gpu.goodput_run import judged_entries, measured
from loadgen.metrics import RequestRecord


def args(*extra: str) -> argparse.Namespace:
    from bench.gpu.goodput import parse_args

    return parse_args(["--model", "tiny", *extra])


def test_deployments_parse_plain_and_per_slo() -> None:
    assert parse_deployments("pd,colocated") == [("pd", None), ("colocated", None)]
    got = parse_deployments("pd_pooled@tight,pd_pooled@loose,colocated")
    assert got == [("pd_pooled", "tight"), ("pd_pooled", "loose"), ("colocated", None)]
    for bad in ("pd@medium", "colocated@loose", "nope", "pd,pd@loose", "pd@loose,pd@loose", ""):
        with pytest.raises(ValueError):
            parse_deployments(bad)


def test_a_run_per_slo_gets_its_guard_from_that_slo() -> None:
    a = args()
    settings, _ = run_settings(a, "tiny")
    assert guard_for(a, settings, "loose") == pytest.approx(0.9 * 25)
    assert guard_for(a, settings, "tight") == pytest.approx(0.9 * 15)
    assert guard_for(a, settings, None) == pytest.approx(0.9 * 15)  # both SLOs: the tighter one's
    given = args("--local-prefill-tpot-ms", "11")
    assert guard_for(given, settings, None) == 11.0 and guard_for(given, settings, "loose") == pytest.approx(22.5)
    apart = args("--disable-mixed-chunk")
    assert guard_for(apart, settings, "loose") == pytest.approx(0.8 * 25)
    share = args("--guard-share", "0.7")
    assert guard_for(share, settings, "tight") == pytest.approx(0.7 * 15)
    assert guard_for(share, settings, None) == pytest.approx(0.7 * 15)
    with pytest.raises(SystemExit, match="guard-share"):
        run_settings(args("--guard-share", "1.5"), "tiny")


def record(ttft_s: float, tpot_s: float) -> RequestRecord:
    return RequestRecord(0, input_len=8, output_len=4, ttft=ttft_s, e2e=ttft_s + 3 * tpot_s, output_tokens=4)


def test_a_run_judged_by_one_slo_counts_only_there(tmp_path: Path) -> None:
    slos = {"loose": {"ttft": 0.5, "tpot": 0.025}, "tight": {"ttft": 0.25, "tpot": 0.015}}
    records = [record(0.1, 0.02)] * 10  # within the loose SLO, past the tight one's TPOT
    both = point_entries("pd_pooled", 8.0, records, 2.0, slos)
    loose_only = judged_entries(both, "loose")
    assert set(loose_only) == {"loose"} and judged_entries(both, None) is both
    # the ladder reads the run's own SLO for both of its brackets
    assert measured(8.0, loose_only) == plan.Measured(8.0, 1.0, 1.0)
    assert measured(8.0, both) == plan.Measured(8.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        measured(8.0, {})
    results = Results({"device": "cpu"})
    results.workload("w", {})
    results.deployment("pd_pooled", {"label": "pooled"})
    results.deployment("pd_pooled", {"guard_ms": 22.5}, "loose")
    results.deployment("pd_pooled", {"guard_ms": 13.5}, "tight")
    results.add_point("w", loose_only)
    results.add_point("w", judged_entries(point_entries("pd_pooled", 4.0, records[:5], 2.0, slos), "tight"))
    data = results.finish()
    assert data["deployments"]["pd_pooled"] == {
        "label": "pooled",
        "by_slo": {"loose": {"guard_ms": 22.5}, "tight": {"guard_ms": 13.5}},
    }
    w = data["workloads"]["w"]
    assert [p["rate"] for p in w["loose"]["points"]] == [8.0] and [p["rate"] for p in w["tight"]["points"]] == [4.0]
    assert w["loose"]["pd_pooled_goodput"] == 8.0 and w["tight"]["pd_pooled_goodput"] is None  # 20 ms > 15 ms


def test_a_later_call_resumes_an_earlier_ones_run(tmp_path: Path) -> None:
    from bench.gpu.goodput import resume

    slos = {"loose": {"ttft": 0.5, "tpot": 0.025}, "tight": {"ttft": 0.25, "tpot": 0.015}}
    head = {"device": "H100", "gpus": ["H100", "H100"], "model": {"kind": "llama8b"}, "slos": {"loose": {}}}
    head["settings"] = {"ladder": {"start": 4.0}, "window_s": 6.0, "seed": 0, "budget_s": 500}
    first = Results({**head, "command": "first"})
    first.workload("w", {})
    first.deployment("colocated", {"start_s": 20.0})
    first.deployment("pd_pooled", {"start_s": 30.0}, "tight")
    good = [record(0.1, 0.01)] * 4
    first.add_point("w", point_entries("colocated", 8.0, good, 1.0, slos))
    first.add_point("w", judged_entries(point_entries("pd_pooled", 8.0, good, 1.0, slos), "tight"))
    path, _ = first.write(tmp_path, "h100")

    second = Results({**head, "command": "second", "settings": {**head["settings"], "budget_s": 300}})
    second.workload("w", {})
    resume(second, path, [("pd_pooled", "loose")])
    second.deployment("pd_pooled", {"start_s": 31.0}, "loose")
    second.add_point("w", judged_entries(point_entries("pd_pooled", 16.0, good, 1.0, slos), "loose"))
    data = second.finish()
    assert data["resumed_from"] == ["first"]
    assert data["deployments"]["pd_pooled"]["by_slo"] == {"tight": {"start_s": 30.0}, "loose": {"start_s": 31.0}}
    w = data["workloads"]["w"]
    assert (w["loose"]["colocated_goodput"], w["loose"]["pd_pooled_goodput"]) == (8.0, 16.0)
    assert (w["tight"]["colocated_goodput"], w["tight"]["pd_pooled_goodput"]) == (8.0, 8.0)
    assert data["goals_by_deployment"]["pd_pooled"]["pd_over_colocated"]["w"] == {"loose": 2.0, "tight": 1.0}
    # a run measured twice, or a run swept another way, is refused
    for again in ([("pd_pooled", "tight")], [("pd_pooled", None)], [("colocated", None)]):
        third = Results({**head, "command": "third"})
        third.workload("w", {})
        with pytest.raises(SystemExit, match="already"):
            resume(third, path, again)
    # unless asked to measure it again: the earlier run's points and record are dropped, the rest kept
    fourth = Results({**head, "command": "fourth"})
    fourth.workload("w", {})
    resume(fourth, path, [("pd_pooled", "tight")], remeasure=True)
    kept = fourth.finish()
    assert kept["remeasured"] == ["pd_pooled@tight"] and "pd_pooled" not in kept["deployments"]
    assert [p["deployment"] for p in kept["workloads"]["w"]["tight"]["points"]] == ["colocated"]
    assert kept["deployments"]["colocated"] == {"start_s": 20.0}
    other = Results({**head, "settings": {**head["settings"], "window_s": 4.0}})
    other.workload("w", {})
    with pytest.raises(SystemExit, match="window_s"):
        resume(other, path, [("pd", None)])


def test_the_knee_resolution_is_a_flag() -> None:
    settings, _ = run_settings(args("--resolution", "1.1"), "tiny")
    assert settings.ladder.resolution == 1.1
    assert run_settings(args(), "tiny")[0].ladder.resolution == plan.Ladder().resolution
    with pytest.raises(SystemExit, match="resolution"):
        run_settings(args("--resolution", "1.0"), "tiny")


def test_second_draws_are_a_flag_and_a_smoke_run_has_none() -> None:
    assert run_settings(args(), "tiny")[0].ladder.max_redraws == plan.Ladder().max_redraws > 0
    assert run_settings(args("--redraws", "1"), "tiny")[0].ladder.max_redraws == 1
    assert run_settings(args("--quick"), "tiny")[0].ladder.max_redraws == 0
    assert run_settings(args("--quick", "--redraws", "2"), "tiny")[0].ladder.max_redraws == 2


def test_a_point_waits_for_a_pooled_router_to_split_again() -> None:
    import asyncio

    import httpx

    from bench.gpu.goodput_run import wait_split

    reads = iter([1.0, 1.0, 0.0])

    def metrics(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=f"pdserve_router_pd_pooled {next(reads)}\n")

    async def go(handler: object, timeout_s: float) -> float:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:  # type: ignore[arg-type]
            return await wait_split(client, "http://router", timeout_s)

    assert 0.4 <= asyncio.run(go(metrics, 10.0)) < 5.0  # two pooled reads, then split
    always = lambda request: httpx.Response(200, text="pdserve_router_pd_pooled 1\n")  # noqa: E731
    assert 0.3 <= asyncio.run(go(always, 0.3)) < 2.0  # bounded
    colocated = lambda request: httpx.Response(200, text="")  # noqa: E731  (no pooling gauge)
    assert asyncio.run(go(colocated, 10.0)) < 0.5


def _report(tmp_path: Path, command: str, points: dict[str, list[tuple[str, str | None, float]]]) -> dict:
    """A one-call report: per workload, (deployment, judged SLO, rate) points all within both SLOs."""
    import json

    slos = {"loose": {"ttft": 0.5, "tpot": 0.025}, "tight": {"ttft": 0.25, "tpot": 0.015}}
    head = {"device": "H200", "gpus": ["H200"] * 2, "model": {"kind": "llama8b"}, "slos": {"loose": {}}}
    r = Results({**head, "command": command, "settings": {"window_s": 6.0, "stream_interval": 4}})
    good = [record(0.1, 0.01)] * 4
    for name, runs in points.items():
        r.workload(name, {})
        for dep, judged, rate in runs:
            r.deployment(dep, {"label": dep})
            r.deployment(dep, {"command": f"{command} {dep}", "start_s": rate}, judged)
            r.add_point(name, judged_entries(point_entries(dep, rate, good, 1.0, slos), judged))
    path, _ = r.write(tmp_path / command, "h200")
    return json.loads(path.read_text())


def test_a_run_returns_in_a_later_call_for_other_workloads_and_reports_merge(tmp_path: Path) -> None:
    """A deployment's run measured on one workload may come back for another (its earlier record kept
    under earlier_calls); the same workload twice is refused; two calls' reports merge after the fact."""
    import json

    from bench.gpu.goodput_resume import main as merge_main, merge, resume

    first = _report(tmp_path, "a", {"w1": [("pd_pooled", "tight", 8.0), ("colocated", None, 6.0)]})
    second = _report(tmp_path, "b", {"w2": [("pd_pooled", "tight", 10.0), ("colocated", None, 7.0)]})
    (tmp_path / "a.json").write_text(json.dumps(first))
    later = Results({k: v for k, v in second.items() if k not in ("deployments", "workloads")})
    later.workload("w2", {})
    resume(later, tmp_path / "a.json", [("pd_pooled", "tight"), ("colocated", None)])
    later.deployment("colocated", {"command": "b colocated"})
    rec = later.finish()["deployments"]["colocated"]
    assert rec["command"] == "b colocated" and rec["earlier_calls"] == [{"command": "a colocated", "start_s": 6.0}]
    again = Results({k: v for k, v in second.items() if k not in ("deployments", "workloads")})
    again.workload("w1", {})
    with pytest.raises(SystemExit, match="pd_pooled@tight on w1 already"):
        resume(again, tmp_path / "a.json", [("pd_pooled", "tight")])

    merged = merge([first, second]).finish()
    assert set(merged["workloads"]) == {"w1", "w2"} and merged["resumed_from"] == ["a"]
    assert merged["workloads"]["w1"]["tight"]["pd_pooled_goodput"] == 8.0
    assert merged["workloads"]["w2"]["loose"]["colocated_goodput"] == 7.0
    tight = merged["deployments"]["pd_pooled"]["by_slo"]["tight"]
    assert tight["command"] == "b pd_pooled" and tight["earlier_calls"] == [{"command": "a pd_pooled", "start_s": 8.0}]
    assert first["deployments"]["colocated"]["command"] == "a colocated"  # the inputs are left as they were
    with pytest.raises(ValueError, match="two reports measured"):
        merge([first, first])
    (tmp_path / "b.json").write_text(json.dumps(second))
    assert merge_main(["--out", str(tmp_path / "m"), str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    written = json.loads((tmp_path / "m" / "goodput_h200.json").read_text())
    assert written["merged_from"][-1].endswith("b.json") and set(written["workloads"]) == {"w1", "w2"}
    other = {**second, "settings": {**second["settings"], "stream_interval": 1}}
    with pytest.raises(ValueError, match="stream_interval"):
        merge([first, other])
