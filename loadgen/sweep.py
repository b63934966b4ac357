"""Load points (Poisson request rate or fixed concurrency), running them, and the JSON report."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar

import httpx

from loadgen.client import Clock, EndpointConfig, make_client, send, served_model
from loadgen.dataset import BenchRequest
from loadgen.heap import settled_heap
from loadgen.metrics import GOODPUT_MIN_ATTAINMENT, RequestRecord, goodput, summarize
from loadgen.reuse import format_groups

U = TypeVar("U")
R = TypeVar("R")

MAX_POOL = 1024  # an unbounded rate would otherwise open one connection per request


@dataclass(frozen=True)
class LoadPoint:
    kind: str  # "rate" (requests/s, Poisson arrivals) or "concurrency" (requests in flight)
    value: float  # math.inf allowed for rate: everything at once

    @property
    def label(self) -> str:
        if math.isinf(self.value):
            return "inf"
        return f"{self.value:g}"

    def to_json(self) -> dict[str, Any]:
        if math.isinf(self.value):
            return {"kind": self.kind, "value": "inf"}  # JSON has no infinity
        return {"kind": self.kind, "value": int(self.value) if self.value.is_integer() else self.value}


def parse_loads(request_rate: str | None, concurrency: str | None) -> list[LoadPoint]:
    """`--request-rate 1,2,4,inf` or `--concurrency 1,4,16` (one of them; rate inf by default)."""
    if request_rate and concurrency:
        raise ValueError("give --request-rate or --concurrency, not both")
    kind, text = ("concurrency", concurrency) if concurrency else ("rate", request_rate or "inf")
    points = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"bad --{'request-rate' if kind == 'rate' else kind} value {part!r}") from None
        bad_conc = kind == "concurrency" and (math.isinf(value) or value != int(value))
        if value <= 0 or math.isnan(value) or bad_conc:
            raise ValueError(f"{kind} values must be positive{' integers' if bad_conc else ''}: {part!r}")
        points.append(LoadPoint(kind, value))
    if not points:
        raise ValueError(f"no {kind} values given")
    return points


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the point's start at which each request is sent (Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_point(
    client: httpx.AsyncClient,
    cfg: EndpointConfig,
    requests: list[BenchRequest],
    load: LoadPoint,
    *,
    seed: int = 0,
    clock: Clock = time.perf_counter,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every request under `load`; returns the records (in request order) and wall time."""

    async def one(req: BenchRequest, t0: float) -> RequestRecord:
        rec = await send(client, cfg, req, t0, clock)
        if on_done is not None:
            on_done(rec)
        return rec

    return await under_load(requests, load, one, seed=seed, clock=clock)


async def under_load(
    units: Sequence[U], load: LoadPoint, work: Callable[[U, float], Awaitable[R]], *, seed: int, clock: Clock
) -> tuple[list[R], float]:
    """Run `work(unit, t0)` for every unit as `load` says (Poisson arrivals of units, or at most
    that many at once); returns the results in unit order and the wall time. The heap is settled
    first (loadgen/heap.py): a collection mid-point would stall every stream the client reads."""
    with settled_heap():
        return await _under_load(units, load, work, seed=seed, clock=clock)


async def _under_load(
    units: Sequence[U], load: LoadPoint, work: Callable[[U, float], Awaitable[R]], *, seed: int, clock: Clock
) -> tuple[list[R], float]:
    t0 = clock()
    gate = asyncio.Semaphore(int(load.value)) if load.kind == "concurrency" else None
    arrivals = arrival_times(len(units), load.value, seed) if load.kind == "rate" else [0.0] * len(units)

    async def one(unit: U, at: float) -> R:
        if at > 0:
            await asyncio.sleep(max(0.0, t0 + at - clock()))
        if gate is None:
            return await work(unit, t0)
        async with gate:
            return await work(unit, t0)

    results = await asyncio.gather(*(one(u, at) for u, at in zip(units, arrivals)))
    return list(results), clock() - t0


@dataclass
class SweepConfig:
    endpoint: EndpointConfig
    loads: list[LoadPoint]
    slo: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    warmup: int = 0
    dataset: dict[str, Any] = field(default_factory=dict)  # how the prompts were made, for the report

    def pool_size(self, n_requests: int) -> int:
        if self.loads[0].kind == "concurrency":
            return int(max(p.value for p in self.loads))
        return max(1, min(n_requests, MAX_POOL))


ProgressFactory = Callable[[str, int], Callable[[RequestRecord], None]]


class Workload(Protocol):
    """What one load point sends; the random workload (FixedRequests) and the prefix-reuse ones."""

    def total(self) -> int: ...  # requests per load point (the progress bar's length)
    def max_in_flight(self) -> int: ...  # the most requests one point can have open at once
    def warmup_requests(self, n: int) -> list[BenchRequest]: ...

    async def run(
        self,
        client: httpx.AsyncClient,
        cfg: EndpointConfig,
        load: LoadPoint,
        point: int,
        seed: int,
        on_done: Callable[[RequestRecord], None] | None,
    ) -> tuple[list[RequestRecord], float]: ...

    def metrics(self, records: list[RequestRecord]) -> dict[str, Any]: ...  # extra keys of a point's metrics


@dataclass
class FixedRequests:
    """The same requests at every load point (the random workload)."""

    requests: list[BenchRequest]

    def total(self) -> int:
        return len(self.requests)

    def max_in_flight(self) -> int:
        return len(self.requests)

    def warmup_requests(self, n: int) -> list[BenchRequest]:
        return [self.requests[i % len(self.requests)] for i in range(n)] if self.requests else []

    async def run(
        self,
        client: httpx.AsyncClient,
        cfg: EndpointConfig,
        load: LoadPoint,
        point: int,
        seed: int,
        on_done: Callable[[RequestRecord], None] | None,
    ) -> tuple[list[RequestRecord], float]:
        return await run_point(client, cfg, self.requests, load, seed=seed, on_done=on_done)

    def metrics(self, records: list[RequestRecord]) -> dict[str, Any]:
        return {}


async def run_sweep(
    cfg: SweepConfig, requests: list[BenchRequest] | Workload, progress: ProgressFactory | None = None
) -> dict[str, Any]:
    """Warm up, run every load point of the workload (a request list: the same requests at every
    point), and return the whole report."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    work = FixedRequests(requests) if isinstance(requests, list) else requests
    async with make_client(cfg.endpoint, cfg.pool_size(work.max_in_flight())) as client:
        endpoint = cfg.endpoint
        if not endpoint.model:
            endpoint = EndpointConfig(**{**asdict(endpoint), "model": await _model_id(client, endpoint)})
        warm = await _warmup(client, endpoint, work.warmup_requests(cfg.warmup))
        points = []
        for i, load in enumerate(cfg.loads):
            on_done = progress(f"{load.kind} {load.label}", work.total()) if progress else None
            records, wall = await work.run(client, endpoint, load, i, cfg.seed + i, on_done)
            points.append(
                {
                    "load": load.to_json(),
                    "metrics": {**summarize(records, wall, cfg.slo), **work.metrics(records)},
                    "requests": [r.to_json() for r in records],
                }
            )
    config = {
        "endpoint": {**asdict(endpoint), "api_key": None},
        "loads": [p.to_json() for p in cfg.loads],
        "slo_s": cfg.slo,
        "seed": cfg.seed,
        "warmup": warm,
        "dataset": cfg.dataset,
    }
    return {"started_at": started, "config": config, "points": points, "goodput": sweep_goodput(cfg, points)}


def sweep_goodput(cfg: SweepConfig, points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Goodput over a swept set of Poisson rates under an SLO (None for concurrency sweeps or no SLO)."""
    if not cfg.slo or cfg.loads[0].kind != "rate":
        return None
    pairs = [(load.value, p["metrics"]["slo_attainment"]) for load, p in zip(cfg.loads, points)]
    return {"req_s": goodput(pairs), "min_attainment": GOODPUT_MIN_ATTAINMENT}


async def _model_id(client: httpx.AsyncClient, cfg: EndpointConfig) -> str:
    try:
        return await served_model(client)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        # Before any request: nothing to measure yet, so this one is a clear error, not a record.
        raise ConnectionError(
            f"cannot read the model id from {cfg.base_url}/v1/models "
            f"({type(e).__name__}: {e}); is the server up? (or pass --model)"
        ) from e


async def _warmup(client: httpx.AsyncClient, cfg: EndpointConfig, batch: list[BenchRequest]) -> dict[str, Any]:
    """The workload's warm-up requests (a few at a time), not counted; failures reported."""
    n = len(batch)
    if n == 0:
        return {"requests": 0, "failed": 0}
    records, _ = await run_point(client, cfg, batch, LoadPoint("concurrency", min(n, 8)))
    failed = [r.error for r in records if not r.ok]
    return {"requests": n, "failed": len(failed), "errors": sorted(set(f or "" for f in failed))[:5]}


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    # inf is not JSON; labels already carry "inf", and SLO/metrics values are finite.
    path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    return path


def format_summary(report: dict[str, Any]) -> str:
    """A plain-text table, one row per load point."""
    head = (
        f"{'load':>12} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} {'in SLO':>7} {'good/s':>7} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8} {'E2E p99':>9}  (ms)"
    )
    rows = [head]
    for p in report["points"]:
        m, load = p["metrics"], p["load"]
        rows.append(
            f"{load['kind'][:4] + ' ' + _num(load['value']):>12} {m['completed']:>5} {m['failed']:>5} "
            f"{m['request_throughput']:>8.2f} {m['output_throughput']:>10.1f} "
            f"{m['slo_attainment']:>7.0%} {m['good_throughput']:>7.2f} "
            f"{_ms(m['ttft_ms']['median']):>9} {_ms(m['ttft_ms']['p99']):>9} "
            f"{_ms(m['tpot_ms']['median']):>9} {_ms(m['itl_ms']['p99']):>8} {_ms(m['e2e_ms']['p99']):>9}"
        )
        rows += format_groups(m)  # per turn / per prefix use, for the prefix-reuse workloads
        for err, count in m["errors"].items():
            rows.append(f"{'':>12} {count} failed: {err}")
    if report.get("goodput"):
        g = report["goodput"]
        best = "none of the rates" if g["req_s"] is None else f"{g['req_s']:g} req/s"
        rows.append(f"goodput (highest rate with >= {g['min_attainment']:.0%} of requests within the SLO): {best}")
    return "\n".join(rows)


def _num(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
