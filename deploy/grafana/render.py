"""Draws the pdserve dashboard's panels as one PNG from a Prometheus server's data (no Grafana needed).

    python deploy/grafana/render.py --prometheus http://127.0.0.1:9090 --minutes 10 --out panels.png

Each panel's queries go to Prometheus' range API (Grafana's $__rate_interval replaced by a fixed
window) and are plotted in a grid titled like the dashboard. The live test draws
deploy/grafana/dashboard.png with it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "pdserve.json"
Series = list[tuple[str, list[float], list[float]]]  # (legend, times, values)


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{params}", timeout=30) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return list(body["data"]["result"])


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's {{label}} legend templates."""
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    while "{{" in out and "}}" in out:  # a label the series does not have
        a = out.index("{{")
        out = out[:a] + out[out.index("}}", a) + 2 :]
    return " ".join(out.split()) or "value"


def panel_series(prom: str, panel: dict[str, Any], start: float, end: float, step: float, window: str) -> Series:
    series: Series = []
    for t in panel["targets"]:
        expr = t["expr"].replace("$__rate_interval", window)
        for r in query_range(prom, expr, start, end, step):
            points = [(float(ts), float(v)) for ts, v in r["values"] if math.isfinite(float(v))]
            if points:
                xs, ys = zip(*points)
                series.append((legend(t.get("legendFormat", ""), r["metric"]), list(xs), list(ys)))
    return series


def draw(panels: list[tuple[dict[str, Any], Series]], out: Path, start: float, columns: int = 4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.1 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (panel, series) in zip(axes.flat, panels):
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        scale, label = {"percentunit": (100.0, "%"), "Bps": (1e-6, "MB/s"), "s": (1e3, "ms")}.get(unit, (1.0, unit))
        ax.set_title(panel["title"], fontsize=10)
        for name, xs, ys in series[:8]:  # Grafana shows more; eight keep a small panel legible
            ax.plot([x - start for x in xs], [y * scale for y in ys], label=name[:40], linewidth=1.2)
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=6, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    fig.suptitle("pdserve dashboard (deploy/grafana/pdserve.json), drawn from Prometheus", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(out, dpi=70)
    plt.close(fig)


def render(
    prom: str, start: float, end: float, out: Path, window: str = "15s", dashboard: Path = DASHBOARD
) -> dict[str, int]:
    """Draw every panel; returns {panel title: number of series drawn}."""
    panels = [p for p in json.loads(dashboard.read_text())["panels"] if p["type"] != "row"]
    step = max(1.0, (end - start) / 300)
    drawn = [(p, panel_series(prom, p, start, end, step, window)) for p in panels]
    draw(drawn, out, start)
    return {p["title"]: len(s) for p, s in drawn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--window", default="1m", help="what $__rate_interval becomes")
    ap.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = ap.parse_args()
    end = time.time()
    counts = render(args.prometheus, end - 60 * args.minutes, end, args.out, args.window)
    print(f"wrote {args.out}: {sum(counts.values())} series in {len(counts)} panels")


if __name__ == "__main__":
    main()
