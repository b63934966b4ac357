"""Per-request timing records and the serving metrics computed from them (pure, clock-free).

SLO attainment is the share of a load point's requests (failed ones included) that meet every
limit of the SLO. Goodput is DistServe's: the highest request rate, among the rates swept, whose
attainment is at least 90% (GOODPUT_MIN_ATTAINMENT); a load point's `good_throughput` is the
requests per second that met the SLO there.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}  # a bare number means milliseconds
PERCENTILES = (50, 90, 99)
GOODPUT_MIN_ATTAINMENT = 0.9  # DistServe's attainment goal


@dataclass
class RequestRecord:
    """One request's outcome; every time is in seconds. `start` is relative to the load point's
    start, `ttft`/`chunk_times`/`e2e` relative to `start` (when the request was sent)."""

    index: int
    input_len: int
    output_len: int
    start: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None
    # usage.prompt_tokens_details.cached_tokens; None when the server does not report it (not 0:
    # "no reuse" and "unknown" must stay apart in the report).
    cached_tokens: int | None = None
    # Prefix-reuse workloads only (loadgen/workloads.py); left out of the JSON when None.
    conversation: int | None = None
    turn: int | None = None  # 1-based
    prefix: int | None = None  # which shared system prompt
    reusable_tokens: int | None = None  # prompt tokens a prefix cache could have served
    reply: str | None = field(default=None, repr=False)  # kept only to build the next turn

    @property
    def ok(self) -> bool:
        return self.error is None

    def itls(self) -> list[float]:
        """Every gap between consecutive content chunks (a chunk may carry several tokens)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for fewer than two tokens."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None or k not in _WORKLOAD_KEYS}
        out.pop("reply", None)  # content, not a measurement: results.json stays small
        return {**out, "tpot": self.tpot()}


_WORKLOAD_KEYS = frozenset({"conversation", "turn", "prefix", "reusable_tokens", "reply"})


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), p in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def distribution_ms(values_s: list[float]) -> dict[str, float | int | None]:
    """mean/median/p90/p99/max in milliseconds; None where there are no samples."""
    out: dict[str, float | int | None] = {"n": len(values_s)}
    ms = [v * 1e3 for v in values_s]
    out["mean"] = sum(ms) / len(ms) if ms else None
    out["median"] = percentile(ms, 50) if ms else None
    for p in PERCENTILES[1:]:
        out[f"p{p}"] = percentile(ms, p) if ms else None
    out["max"] = max(ms) if ms else None
    return out


def stream_stalls(records: list[RequestRecord]) -> dict[str, float | None]:
    """Where a load point's streams stood still, in ms: the longest gap between two chunks of one
    request, and the longest silence of the whole service, a span in which some request had its
    first token and not yet its last but no request received anything (`silence_at_s`: when it
    began, from the point's start). A stall of the server shows as a silence; a slow stream alone
    as a gap."""
    gaps = [g for r in records for g in r.itls()]
    spans = sorted((r.start + r.chunk_times[0], r.start + r.chunk_times[-1]) for r in records if len(r.chunk_times) > 1)
    arrivals = sorted(r.start + t for r in records for t in r.chunk_times)
    silence, at = 0.0, None
    active_until, i = float("-inf"), 0
    for a, b in zip(arrivals, arrivals[1:]):
        while i < len(spans) and spans[i][0] <= a:  # streams begun by `a`: the latest of their ends
            active_until = max(active_until, spans[i][1])
            i += 1
        if active_until >= b and b - a > silence:  # a stream begun by `a` was still to end at `b`
            silence, at = b - a, a
    return {
        "longest_gap_ms": max(gaps) * 1e3 if gaps else None,
        "longest_silence_ms": silence * 1e3 if at is not None else None,
        "silence_at_s": at,
    }


class SLOError(ValueError):
    """A malformed --slo string; the message names the bad part."""


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=500ms,tpot=50ms` -> {"ttft": 0.5, "tpot": 0.05} (seconds). Units us, ms, s."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*", value)
        if not sep or name not in SLO_METRICS or match is None:
            raise SLOError(f"bad SLO {part!r}: expected NAME=VALUE[us|ms|s] with NAME one of {', '.join(SLO_METRICS)}")
        slo[name] = float(match.group(1)) * _UNITS[match.group(2) or "ms"]
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request within every limit. TPOT/ITL limits pass vacuously with one token
    (there is no decode step to judge); `itl` bounds the worst gap of the request."""
    if not record.ok or record.ttft is None or record.e2e is None:
        return False
    measured = {"ttft": record.ttft, "e2e": record.e2e, "tpot": record.tpot(), "itl": max(record.itls(), default=None)}
    return all(measured[k] is None or measured[k] <= limit for k, limit in slo.items())


def slo_attainment(records: list[RequestRecord], slo: dict[str, float]) -> float:
    """Share of `records` that succeeded within every limit of `slo` (0 for no records)."""
    return sum(meets_slo(r, slo) for r in records) / len(records) if records else 0.0


def goodput(points: Iterable[tuple[float, float]], min_attainment: float = GOODPUT_MIN_ATTAINMENT) -> float | None:
    """The highest request rate among `points` ((rate, SLO attainment) pairs) whose attainment is at
    least `min_attainment`; None when none is. Taken as swept: a lower rate that missed does not
    disqualify a higher one that met it. An infinite rate (everything at once) is not a rate: skipped."""
    rates = [rate for rate, attained in points if attained >= min_attainment and math.isfinite(rate)]
    return max(rates, default=None)


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The metrics of one load point; throughputs divide by the point's wall time."""
    ok = [r for r in records if r.ok]
    good = [r for r in ok if meets_slo(r, slo or {})]
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "input_throughput": rate(in_tokens),
        "output_throughput": rate(out_tokens),
        "good_throughput": rate(len(good)),
        "good_requests": len(good),
        "slo_attainment": len(good) / len(records) if records else 0.0,
        "slo": dict(slo or {}),
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot()) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itls()]),
        "e2e_ms": distribution_ms([r.e2e for r in ok if r.e2e is not None]),
        "errors": dict(Counter(r.error for r in records if r.error is not None).most_common(10)),
    }
