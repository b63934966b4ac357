"""One goodput comparison from several calls: `--resume` on the device, or merging their reports after.

A call's time limit is shorter than a full comparison, so a run goes on over several calls on the
same machine with the same settings. A deployment's run may return in a later call for workloads it
has not measured yet (the earlier call's record of it is kept under `earlier_calls`); measuring a
workload twice is refused, unless `--remeasure` drops the earlier call's points of it first.

Merge reports written by separate calls (each with every setting of SAME_SETTINGS alike):
  python -m bench.gpu.goodput_resume --out bench/results first.json second.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from bench.common import short_name
from bench.gpu.goodput_report import SLO_NAMES, Results, summary_text

Run = tuple[str, str | None]  # a deployment and the SLO it alone is judged by (None: both)


def run_name(dep: str, judged: str | None) -> str:
    return f"{dep}@{judged}" if judged else dep


def measured_workloads(report: dict[str, Any], dep: str, judged: str | None) -> set[str]:
    """The workloads that have points of `dep`'s run in `report` (a plain run counts for both SLOs,
    so any point of the topology clashes with it; a run judged by one SLO, its points there)."""
    slos = [judged] if judged else list(SLO_NAMES)
    return {
        name
        for name, w in report.get("workloads", {}).items()
        if any(p["deployment"] == dep for slo in slos for p in w.get(slo, {}).get("points", ()))
    }


def _record(report: dict[str, Any], dep: str, judged: str | None) -> dict[str, Any] | None:
    entry = report.get("deployments", {}).get(dep)
    if entry is None:
        return None
    return entry.get("by_slo", {}).get(judged) if judged else entry


def keep_as_earlier_call(report: dict[str, Any], dep: str, judged: str | None) -> None:
    """Move `report`'s record of a run (command, log, start time) under its `earlier_calls`, so the
    later call that measures the same run on other workloads adds its own beside it."""
    record = _record(report, dep, judged)
    if not record:
        return
    own = {k: v for k, v in record.items() if k not in ("label", "by_slo", "earlier_calls")}
    if not own:
        return
    for key in own:
        del record[key]
    record["earlier_calls"] = [*record.get("earlier_calls", []), own]


def drop_run(report: dict[str, Any], dep: str, judged: str | None, workloads: Iterable[str]) -> str:
    """Remove the points of `dep`'s run (under the SLOs it counted for) in `workloads`, and their
    curves; its record goes too when no point of it is left. Returns the run's name."""
    slos = [judged] if judged else list(SLO_NAMES)
    for name in workloads:
        w = report.get("workloads", {}).get(name)
        if w is None:
            continue
        for slo in slos:
            w[slo]["points"] = [p for p in w[slo]["points"] if p["deployment"] != dep]
        if not any(p["deployment"] == dep for slo in SLO_NAMES for p in w[slo]["points"]):
            w.get("curves", {}).pop(dep, None)
    if not measured_workloads(report, dep, judged):
        entry = report.get("deployments", {}).get(dep, {})
        if judged and "by_slo" in entry:
            entry["by_slo"].pop(judged, None)
        if not judged or not entry.get("by_slo"):
            report.get("deployments", {}).pop(dep, None)
    return run_name(dep, judged)


def join(
    results: Results, earlier: dict[str, Any], runs: Sequence[Run], workloads: Sequence[str], remeasure: bool
) -> None:
    """Take `earlier` into `results`, whose call measures `runs` on `workloads`: a run may come back
    for other workloads, not for one it measured (unless `remeasure`, which drops those points)."""
    dropped = []
    for dep, judged in runs:
        twice = measured_workloads(earlier, dep, judged) & set(workloads)
        if twice and not remeasure:
            raise ValueError(f"it has measured {run_name(dep, judged)} on {', '.join(sorted(twice))} already")
        if twice:
            dropped.append(drop_run(earlier, dep, judged, twice))
        keep_as_earlier_call(earlier, dep, judged)
    results.absorb(earlier)
    if dropped:
        results.data["remeasured"] = [*results.data.get("remeasured", []), *dropped]


def resume(
    results: Results, path: Path, runs: Sequence[Run], remeasure: bool = False, workloads: Sequence[str] | None = None
) -> None:
    """`--resume`: carry an earlier call's report into this one, which measures `runs` on
    `workloads` (default: every workload this report has)."""
    chosen = list(results.data["workloads"]) if workloads is None else list(workloads)
    try:
        join(results, json.loads(path.read_text()), runs, chosen, remeasure)
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot resume from {path}: {e}") from None


def runs_in(report: dict[str, Any]) -> list[Run]:
    """Every run a report has a record of: a plain deployment, or each SLO's run of a split one."""
    out: list[Run] = []
    for dep, entry in report.get("deployments", {}).items():
        out += [(dep, slo) for slo in entry["by_slo"]] if "by_slo" in entry else [(dep, None)]
    return out


def merge(reports: Sequence[dict[str, Any]]) -> Results:
    """Reports of several calls, in the order they ran, as one (the last one's header)."""
    if not reports:
        raise ValueError("nothing to merge")
    results = Results({})
    results.data = json.loads(json.dumps(reports[-1]))  # a copy: the caller's report stays as it was
    for report in reversed(reports[:-1]):
        earlier, later = json.loads(json.dumps(report)), results.data
        for dep, judged in runs_in(later):
            twice = measured_workloads(earlier, dep, judged) & measured_workloads(later, dep, judged)
            if twice:
                raise ValueError(f"two reports measured {run_name(dep, judged)} on {', '.join(sorted(twice))}")
            keep_as_earlier_call(earlier, dep, judged)
        results.absorb(earlier)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Merge goodput reports of several calls into one (and its plot).")
    p.add_argument("reports", nargs="+", type=Path, help="the calls' goodput JSON files, in the order they ran")
    p.add_argument("--out", type=Path, required=True, help="folder for goodput_<gpu>.json and .png")
    args = p.parse_args(argv)
    try:
        merged = merge([json.loads(path.read_text()) for path in args.reports])
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot merge: {e}") from None
    merged.data["merged_from"] = [str(path) for path in args.reports]
    args.out.mkdir(parents=True, exist_ok=True)
    path, png = merged.write(args.out, short_name(merged.data.get("device", "cpu")))
    print(summary_text(merged.data))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
