"""The router's per-request route lines (debug level, router/dispatch.py) summed up: where requests
went and why, and the remote ones whose decode held more of the prompt than their prefill (what a
prefix cache loses when a follow-up is computed away from its history)."""

from __future__ import annotations

import ast
import re
import statistics
from collections import Counter
from typing import Any

ROUTE = re.compile(
    r"route (?P<rid>\S+): path (?P<path>\w+) \((?P<reason>[\w-]+)\), (?P<tokens>\d+) prompt tokens, "
    r"expected held (?P<held>\{[^}]*\}), estimates remote (?P<remote>\S+) ms local (?P<local>\S+) ms"
)


def _ms(text: str) -> float | None:
    return None if text == "-" else float(text)


def route_summary(log_text: str) -> dict[str, Any]:
    """Requests by `path/reason`, and the remote ones that left history on their decode: how many,
    the prompt tokens the prefill recomputed for it, and the local estimate they were refused on."""
    by_reason: Counter[str] = Counter()
    left, recomputed, refused_ms = 0, 0, []
    for m in ROUTE.finditer(log_text):
        if m["rid"].startswith("probe-"):  # the router's own readiness probes
            continue
        by_reason[f"{m['path']}/{m['reason']}"] += 1
        held: dict[str, int] = ast.literal_eval(m["held"])
        extra = held.get("decode", 0) - held.get("prefill", 0)
        if m["path"] == "remote" and extra > 0:
            left, recomputed = left + 1, recomputed + extra
            if (local := _ms(m["local"])) is not None:
                refused_ms.append(local)
    return {
        "by_reason": dict(sorted(by_reason.items())),
        "remote_with_history_on_decode": {
            "requests": left,
            "tokens_recomputed": recomputed,
            "local_estimate_ms_p50": statistics.median(refused_ms) if refused_ms else None,
        },
    }
