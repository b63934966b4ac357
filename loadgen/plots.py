"""PNG plots of a sweep: latency percentiles vs load and throughput vs load (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end"))
STATS = ("mean", "median", "p90", "p99")
THROUGHPUTS = (
    ("request_throughput", "requests/s"),
    ("good_throughput", "requests/s within the SLO"),
    ("output_throughput", "output tokens/s"),
)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers or in CI
    import matplotlib.pyplot as plt

    return plt


def _axis(report: dict[str, Any]) -> tuple[list[int], list[str], str]:
    """Load points are evenly spaced and labelled (a rate of inf has no place on a numeric axis)."""
    loads = [p["load"] for p in report["points"]]
    kind = loads[0]["kind"] if loads else "rate"
    name = "request rate (req/s, Poisson)" if kind == "rate" else "concurrency"
    labels = [v if isinstance(v := ld["value"], str) else f"{v:g}" for ld in loads]
    return list(range(len(loads))), labels, name


def plot_latency(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    xs, labels, name = _axis(report)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, LATENCIES):
        for stat in STATS:
            ys = [p["metrics"][key][stat] for p in report["points"]]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=stat)
        ax.set(title=f"{title} (ms)", xlabel=name, ylabel="ms", xticks=xs, xticklabels=labels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, "latency vs load", path)


def plot_throughput(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    xs, labels, name = _axis(report)
    fig, axes = plt.subplots(1, len(THROUGHPUTS), figsize=(14, 4))
    slo = report.get("config", {}).get("slo_s") or {}
    for ax, (key, title) in zip(axes, THROUGHPUTS):
        if key == "good_throughput" and slo:
            title += "\n" + ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items())
            best = (report.get("goodput") or {}).get("req_s")
            if best is not None:
                title += f"; goodput {best:g} req/s"
        ax.plot(xs, [p["metrics"][key] for p in report["points"]], marker="o")
        ax.set(title=title, xlabel=name, xticks=xs, xticklabels=labels)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(plt, fig, "throughput vs load", path)


def _save(plt: Any, fig: Any, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_latency(report, out_dir / "latency.png"), plot_throughput(report, out_dir / "throughput.png")]
