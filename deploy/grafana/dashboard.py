"""Generates deploy/grafana/pdserve.json (the pdserve Grafana dashboard) with grafana-foundation-sdk.

    python deploy/grafana/dashboard.py          # rewrite pdserve.json
    python deploy/grafana/dashboard.py --check  # exit 1 if pdserve.json is not what this writes

Every query uses the metric names of engine/service/metrics.py and router/metrics.py; the
tests parse each one with promtool and run it against a live stack (tests/deploy).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DataSourceRef, ValueMap, ValueMappingResult

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo's packages
from deploy.grafana.panels import ROWS, Panel  # noqa: E402

OUT = Path(__file__).resolve().parent / "pdserve.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")


def _panel(p: Panel) -> timeseries.Panel:
    b = (
        timeseries.Panel()
        .title(p.title)
        .description(p.description)
        .unit(p.unit)
        .datasource(DS)
        .height(8)
        .span(12)
        .line_width(1)
        .fill_opacity(10)
        .legend(
            common.VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    for i, (expr, legend) in enumerate(p.targets):
        b = b.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i)))
    if p.mappings:
        b = b.mappings([ValueMap(options={str(v): ValueMappingResult(text=t) for v, t in p.mappings.items()})])
    return b


def build() -> str:
    """The dashboard as JSON text (stable: the test compares it with the committed file)."""
    d = (
        dashboard.Dashboard("pdserve")
        .uid("pdserve")
        .tags(["pdserve", "llm", "disaggregated"])
        .description(
            "pdserve router and prefill/decode nodes: traffic, TTFT by stage, KV cache, "
            "PD queues, speculative acceptance, KV transfer, prefill paths and tier balance, the prefix cache, "
            "retries and breakers."
        )
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for title, panels in ROWS:
        d = d.with_row(dashboard.Row(title))
        for p in panels:
            d = d.with_panel(_panel(p))
    return (
        json.dumps(json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build())), indent=1, sort_keys=True) + "\n"
    )


def main(argv: list[str]) -> int:
    text = build()
    if "--check" in argv:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'differs from the generator; run it'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
