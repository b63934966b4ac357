"""The goodput benchmark's results: each measured point under both SLOs, each deployment's goodput,
the JSON layout, a text summary and the attainment plot (one panel per workload and SLO)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from bench.common import write_report
from loadgen.metrics import GOODPUT_MIN_ATTAINMENT, RequestRecord, goodput, summarize

DEPLOYMENTS = ("pd", "colocated")  # always reported (null when not measured); others when measured
SLO_NAMES = ("loose", "tight")
GOODPUT_DEFINITION = (
    f"the highest swept Poisson rate (requests/s) at which at least {GOODPUT_MIN_ATTAINMENT:.0%} of the "
    "requests met both the TTFT and the TPOT limit (DistServe's); null when no swept rate did"
)


def _percentiles(dist: dict[str, Any]) -> dict[str, float | None]:
    return {"p50": dist["median"], "p90": dist["p90"], "p99": dist["p99"]}


def point_entries(
    deployment: str, rate: float, records: list[RequestRecord], wall_s: float, slos: dict[str, dict[str, float]]
) -> dict[str, dict[str, Any]]:
    """One measured point as an entry per SLO: the same requests, judged by each SLO (latency
    percentiles are over the requests that completed; a request cut at the loose SLO's bound
    counts as outside both SLOs)."""
    out = {}
    for name, slo in slos.items():
        m = summarize(records, wall_s, slo)
        out[name] = {
            "deployment": deployment,
            "rate": rate,
            "attainment": m["slo_attainment"],
            "requests": m["requests"],
            "completed": m["completed"],
            "failed": m["failed"],
            "cut": sum(1 for r in records if r.error is not None and r.error.startswith("timeout")),
            "request_throughput": m["request_throughput"],
            "output_throughput": m["output_throughput"],
            "good_throughput": m["good_throughput"],
            "duration_s": wall_s,
            "ttft_ms": _percentiles(m["ttft_ms"]),
            "tpot_ms": _percentiles(m["tpot_ms"]),
            "errors": m["errors"],
        }
    return out


def prior_knees(prior: dict[str, Any], workload: str, deployment: str, slos: Sequence[str]) -> tuple[float, ...]:
    """An earlier report's goodput of this curve under each of `slos` where it found one."""
    blocks = prior.get("workloads", {}).get(workload, {})
    found = (blocks.get(slo, {}).get(f"{deployment}_goodput") for slo in slos)
    return tuple(float(g) for g in found if g)


class Results:
    """The report being built; `write` may run after every curve (a cut-short run keeps its points)."""

    def __init__(self, header: dict[str, Any]) -> None:
        self.data: dict[str, Any] = {**header, "deployments": {}, "workloads": {}}

    def workload(self, name: str, info: dict[str, Any]) -> None:
        self.data["workloads"].setdefault(name, {**info, **{s: {"points": []} for s in SLO_NAMES}, "curves": {}})

    def deployment(self, name: str, info: dict[str, Any], judged: str | None = None) -> None:
        """About a deployment, or (`judged`) about its run set up for, and judged by, that SLO alone."""
        entry = self.data["deployments"].setdefault(name, {})
        (entry.setdefault("by_slo", {}).setdefault(judged, {}) if judged else entry).update(info)

    def add_point(self, workload: str, entries: dict[str, dict[str, Any]], **extra: Any) -> None:
        for slo, entry in entries.items():
            self.data["workloads"][workload][slo]["points"].append({**entry, **extra})

    def merge_draw(
        self, workload: str, deployment: str, rate: float, entries: dict[str, dict[str, Any]], draw: dict[str, Any]
    ) -> None:
        """A further draw at a measured rate: its point's figures become `entries` (over every draw's
        requests) and `draw` joins the point's `draws`; the first draw's router and node signals stay."""
        for slo, entry in entries.items():
            points = self.data["workloads"][workload][slo]["points"]
            point = next(p for p in points if p["deployment"] == deployment and p["rate"] == rate)
            point.update(entry)
            point["draws"] = [*point.get("draws", []), draw]  # a new list: the SLOs' points shared one

    def curve(self, workload: str, deployment: str, **info: Any) -> None:
        """About one curve: its warm-up, why it ended (the ladder was done, or time or points ran out)."""
        self.data["workloads"][workload]["curves"].setdefault(deployment, {}).update(info)

    def absorb(self, earlier: dict[str, Any]) -> None:
        """Take in an earlier report's points, curves and deployments (`--resume`): a comparison
        that does not fit one call's time runs in several calls on the same machine. Refused
        unless the earlier run swept the same way on the same devices and model (which runs may
        return is bench/gpu/goodput_resume.py's to check)."""
        for key in SAME_RUN_KEYS:
            if earlier.get(key) != self.data.get(key):
                raise ValueError(f"the earlier report's {key} differs: {earlier.get(key)!r} vs {self.data.get(key)!r}")
        mine, theirs = self.data.get("settings", {}), earlier.get("settings", {})
        for key in SAME_SETTINGS:
            if theirs.get(key) != mine.get(key):
                raise ValueError(
                    f"the earlier report's setting {key} differs: {theirs.get(key)!r} vs {mine.get(key)!r}"
                )
        self.data["resumed_from"] = [*earlier.get("resumed_from", []), earlier.get("command")]
        for name, info in earlier.get("deployments", {}).items():
            join_record(self.data["deployments"].setdefault(name, {}), info)
        for wname, w in earlier.get("workloads", {}).items():
            here = self.data["workloads"].get(wname)
            if here is None:
                self.data["workloads"][wname] = w
                continue
            for slo in SLO_NAMES:
                here[slo]["points"][:0] = w[slo]["points"]
            here["curves"] = {**w.get("curves", {}), **here["curves"]}

    def finish(self) -> dict[str, Any]:
        """Goodput per workload, SLO and deployment from the points, and the summary; returns the data."""
        summary: dict[str, dict[str, Any]] = {}
        deployments = reported(self.data)
        for wname, w in self.data["workloads"].items():
            for slo in SLO_NAMES:
                block = w[slo]
                for dep in deployments:
                    mine = [p for p in block["points"] if p["deployment"] == dep]
                    best = goodput((p["rate"], p["attainment"]) for p in mine)
                    block[f"{dep}_goodput"] = best
                    # met at the highest rate tried: the knee lies above it, not measured
                    block[f"{dep}_goodput_is_lower_bound"] = best is not None and best >= max(p["rate"] for p in mine)
                    block[f"{dep}_goodput_by_draw"] = goodput_by_draw(mine, slo)
            summary[wname] = {dep: w["loose"][f"{dep}_goodput"] for dep in deployments}
        self.data["highest_rate_within_loose_slo"] = summary
        self.data["goals"] = goals(self.data["workloads"])
        others = [d for d in deployments if d.startswith("pd_")]  # pd_remote, pd_pooled: judged the same way
        if others:
            self.data["goals_by_deployment"] = {d: goals(self.data["workloads"], d) for d in others}
        return self.data

    def write(self, out_dir: Path, gpu: str) -> tuple[Path, Path | None]:
        """goodput_<gpu>.json and, when matplotlib is there, goodput_<gpu>.png beside it."""
        path = out_dir / f"goodput_{gpu}.json"
        write_report(path, self.finish())
        try:
            png = plot(self.data, out_dir / f"goodput_{gpu}.png")
        except ImportError:  # the bench extra (matplotlib) is not installed: the JSON is the result
            png = None
        return path, png


def join_record(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """An earlier call's record of a deployment laid under this call's: each SLO's run joined the
    same way, earlier calls listed first, and this call's own figures kept where both have them."""
    for key, value in theirs.items():
        if key == "by_slo":
            for slo, record in value.items():
                join_record(mine.setdefault("by_slo", {}).setdefault(slo, {}), record)
        elif key == "earlier_calls":
            mine[key] = [*value, *mine.get(key, [])]
        else:
            mine.setdefault(key, value)


def goodput_by_draw(points: list[dict[str, Any]], slo: str) -> list[float | None]:
    """The goodput each Poisson draw alone gives: draw k of every rate (its last where it has
    fewer), one figure per draw; where they differ, one draw would have decided the goodput."""
    most = max((len(p.get("draws", ())) for p in points), default=0)
    out = []
    for k in range(most):
        drawn = [
            (p["rate"], p["draws"][min(k, len(p["draws"]) - 1)]["attainment"].get(slo))
            for p in points
            if p.get("draws")
        ]
        out.append(goodput((rate, a) for rate, a in drawn if a is not None))
    return out


# What two reports must share for their points to be one comparison (--resume)
SAME_RUN_KEYS = ("device", "gpus", "model", "slos")
SAME_SETTINGS = (
    "ladder",
    "window_s",
    "requests_per_point",
    "max_running",
    "mixed_chunk",
    "seed",
    "focus",
    "prompt_graph_tokens",
    "stream_interval",
)

# PD's goodput against colocated's that the benchmark exists to show (each curve, every workload)
GOAL_EVERY_CURVE, GOAL_TIGHT, GOAL_TIGHT_WORKLOADS, GOAL_LOOSE = 1.0, 1.3, 2, 1.2


def goals(workloads: dict[str, Any], pd_deployment: str = "pd") -> dict[str, Any]:
    """PD (`pd_deployment`) over colocated per workload and SLO (null where either has no goodput)
    and whether each goal is met: at least 1.0x on every curve, 1.3x under the tight SLO on two
    workloads, 1.2x the highest rate within the loose SLO on every workload."""
    ratios: dict[str, dict[str, float | None]] = {}
    for wname, w in workloads.items():
        for slo in SLO_NAMES:
            pd, co = w[slo].get(f"{pd_deployment}_goodput"), w[slo].get("colocated_goodput")
            ratios.setdefault(wname, {})[slo] = pd / co if pd is not None and co else None
    known = [r for by_slo in ratios.values() for r in by_slo.values()]
    tight = sum(1 for by_slo in ratios.values() if (r := by_slo["tight"]) is not None and r >= GOAL_TIGHT)
    loose = [by_slo["loose"] for by_slo in ratios.values()]
    return {
        "pd_over_colocated": ratios,
        "every_curve_at_least_colocated": bool(known) and all(r is not None and r >= GOAL_EVERY_CURVE for r in known),
        "tight_workloads_at_1_3x": tight,
        "tight_goal_met": tight >= GOAL_TIGHT_WORKLOADS,
        "loose_highest_rate_goal_met": bool(loose) and all(r is not None and r >= GOAL_LOOSE for r in loose),
    }


def reported(data: dict[str, Any]) -> list[str]:
    """The deployments a report has goodput entries for: PD and colocated, then any other measured."""
    return [*DEPLOYMENTS, *(d for d in data.get("deployments", {}) if d not in DEPLOYMENTS)]


def summary_text(data: dict[str, Any]) -> str:
    """One line per workload and SLO: each deployment's goodput and PD's over colocated."""
    others = [d for d in reported(data) if d not in DEPLOYMENTS]
    head = "".join(f" {d + ' req/s':>16}" for d in others)
    rows = [f"{'workload':<14} {'SLO':<6} {'PD req/s':>9} {'coloc req/s':>12} {'PD/coloc':>9}{head}"]
    for wname, w in data["workloads"].items():
        for slo in SLO_NAMES:
            pd, co = w[slo]["pd_goodput"], w[slo]["colocated_goodput"]
            ratio = f"{pd / co:.2f}" if pd is not None and co else "-"
            extra = "".join(f" {_rate(w[slo].get(d + '_goodput')):>16}" for d in others)
            rows.append(f"{wname:<14} {slo:<6} {_rate(pd):>9} {_rate(co):>12} {ratio:>9}{extra}")
    return "\n".join(rows)


def _rate(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"


def plot(data: dict[str, Any], path: Path) -> Path:
    """Attainment against rate, PD and colocated, the target line; one panel per workload and SLO."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    workloads = list(data["workloads"])
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.4 * len(workloads)), squeeze=False)
    colors = {"pd": "tab:blue", "colocated": "tab:orange", "pd_remote": "tab:green"}
    for row, wname in zip(axes, workloads):
        for ax, slo in zip(row, SLO_NAMES):
            block = data["workloads"][wname][slo]
            for dep in reported(data):
                pts = sorted((p["rate"], p["attainment"]) for p in block["points"] if p["deployment"] == dep)
                if pts:
                    best = block.get(f"{dep}_goodput")
                    label = f"{dep} (goodput {_rate(best)})"
                    ax.plot(*zip(*pts), marker="o", color=colors.get(dep), label=label)
                    if best is not None:
                        ax.axvline(best, color=colors.get(dep), linestyle=":", alpha=0.6)
            ax.axhline(GOODPUT_MIN_ATTAINMENT, color="gray", linestyle="--", linewidth=1)
            limits = data.get("slos", {}).get(slo, {})
            spec = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g} ms" for k, v in limits.items())
            ax.set(title=f"{wname}, {slo} SLO ({spec})", xlabel="request rate (req/s, Poisson)", ylabel="attainment")
            rates = sorted({p["rate"] for p in block["points"]})
            if rates:
                ax.set_xscale("log")  # the ladder's rates are geometric
                ax.set_xticks(rates, [f"{r:g}" for r in rates], fontsize=7)
                ax.minorticks_off()
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            if block["points"]:
                ax.legend(fontsize=8)
    fig.suptitle(f"SLO attainment, PD 1P1D vs two colocated replicas ({data.get('device', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
