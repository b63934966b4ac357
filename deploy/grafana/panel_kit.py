"""What every dashboard row is made of: a Panel, Grafana's rate window, and the quantile query."""

from __future__ import annotations

from dataclasses import dataclass, field

W = "$__rate_interval"  # Grafana's rate window: at least four scrape intervals


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    mappings: dict[int, str] = field(default_factory=dict)  # value -> text (breaker states)


def quantile(p: float, metric: str, by: str = "le", match: str = "") -> str:
    return f"histogram_quantile({p}, sum by ({by}) (rate({metric}_bucket{match}[{W}])))"
