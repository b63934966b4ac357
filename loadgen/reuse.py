"""Prefix-cache accounting for the reuse workloads: cached vs reusable prompt tokens, per-group latency.

Cached tokens are what the server says it served from its prefix cache
(`usage.prompt_tokens_details.cached_tokens` of the final streamed chunk). Reusable tokens are
what a perfect prefix cache could have served, by the workload's own construction:

- multi-turn: turn 1 has none; turn t > 1 can reuse the previous turn's prompt plus its reply,
  counted as the server tokenized them (previous `prompt_tokens` + `completion_tokens`) and capped
  by this turn's `prompt_tokens`; unknown (None) when the server sent no usage.
- shared-prefix: the system prompt's `--prefix-len` tokens for every request after the first one
  (in send order) with that prefix, capped by its `prompt_tokens`; 0 for the first.

`reuse_ratio` = cached / reusable over the completed requests where both are known; it is None
when the server reports no cached tokens (None is "not reported", never 0) or nothing was
reusable, and may exceed 1 when the server reuses more than the workload planned (a chat
template's common start, or KV left from an earlier run).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from loadgen.metrics import RequestRecord, distribution_ms


def multi_turn_reusable(previous: RequestRecord | None, current: RequestRecord) -> int | None:
    """Reusable prompt tokens of `current` given the same conversation's previous turn."""
    if previous is None:
        return 0
    if previous.prompt_tokens is None or current.prompt_tokens is None:
        return None  # no usage from the server: the history's token count is unknown
    return min(previous.prompt_tokens + previous.output_tokens, current.prompt_tokens)


def mark_shared_prefix(records: Sequence[RequestRecord], prefix_of: Sequence[int], prefix_len: int) -> None:
    """Set each record's prefix and reusable tokens (records and `prefix_of` in index order)."""
    seen: set[int] = set()
    for rec, prefix in zip(records, prefix_of):
        rec.prefix = prefix
        if prefix not in seen:
            rec.reusable_tokens = 0
        else:
            rec.reusable_tokens = prefix_len if rec.prompt_tokens is None else min(prefix_len, rec.prompt_tokens)
        seen.add(prefix)


def cache_accounting(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Prompt, cached and reusable token sums of the completed `records`, and their reuse ratio."""
    ok = [r for r in records if r.ok]
    reported = [r for r in ok if r.cached_tokens is not None]
    known = [r for r in ok if r.reusable_tokens is not None]
    both = [r for r in reported if r.reusable_tokens is not None]
    reusable_both = sum(r.reusable_tokens or 0 for r in both)
    return {
        "prompt_tokens": sum(r.prompt_tokens for r in ok if r.prompt_tokens is not None),
        "cached_tokens": sum(r.cached_tokens or 0 for r in reported) if reported else None,
        "reusable_tokens": sum(r.reusable_tokens or 0 for r in known) if known else None,
        "reuse_ratio": sum(r.cached_tokens or 0 for r in both) / reusable_both if reusable_both else None,
        "requests_reporting_cached": len(reported),
    }


def group_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Latency percentiles and cache accounting of one group of requests (a turn, first uses...)."""
    ok = [r for r in records if r.ok]
    return {
        "requests": len(records),
        "completed": len(ok),
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot()) is not None]),
        **cache_accounting(records),
    }


def grouped(records: Sequence[RequestRecord], key: Callable[[RequestRecord], list[str]]) -> dict[str, Any]:
    """`group_metrics` per label; `key` gives each record's labels (a record may be in several)."""
    groups: dict[str, list[RequestRecord]] = {}
    for rec in records:
        for label in key(rec):
            groups.setdefault(label, []).append(rec)
    return {label: group_metrics(recs) for label, recs in groups.items()}


def turn_labels(rec: RequestRecord) -> list[str]:
    """Turn t's own label, and "3+" for every turn from the third on."""
    turn = rec.turn or 1
    return [str(turn)] + (["3+"] if turn >= 3 else [])


def turn_order(label: str) -> tuple[int, int]:
    """Numeric turns first, in order, then "3+"."""
    return (1, 0) if label == "3+" else (0, int(label))


def multi_turn_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    by_turn = grouped(records, turn_labels)
    ordered = {k: by_turn[k] for k in sorted(by_turn, key=turn_order)}
    return {"prefix_cache": cache_accounting(records), "by_turn": ordered}


def shared_prefix_metrics(records: Sequence[RequestRecord]) -> dict[str, Any]:
    by_use = grouped(records, lambda r: ["repeat" if r.reusable_tokens else "first"])
    ordered = {k: by_use[k] for k in ("first", "repeat") if k in by_use}
    return {"prefix_cache": cache_accounting(records), "by_prefix_use": ordered}


def format_groups(metrics: dict[str, Any]) -> list[str]:
    """Summary lines of a point's groups: TTFT/TPOT p50/p99 and cached/reusable tokens."""
    groups = metrics.get("by_turn") or metrics.get("by_prefix_use") or {}
    kind = "turn" if "by_turn" in metrics else "prefix"
    rows = []
    for label, g in groups.items():
        cache = "cached n/a" if g["cached_tokens"] is None else f"cached {g['cached_tokens']}"
        reusable = "?" if g["reusable_tokens"] is None else g["reusable_tokens"]
        ratio = "" if g["reuse_ratio"] is None else f" ({g['reuse_ratio']:.0%})"
        rows.append(
            f"{'':>12} {kind} {label:<6} n={g['completed']:<5} TTFT p50/p99 {_ms(g['ttft_ms']['median'])}/"
            f"{_ms(g['ttft_ms']['p99'])}  TPOT p50/p99 {_ms(g['tpot_ms']['median'])}/{_ms(g['tpot_ms']['p99'])} ms"
            f"  {cache} of {reusable} reusable{ratio}"
        )
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
