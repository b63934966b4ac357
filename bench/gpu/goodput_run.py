"""Measuring one started deployment: per workload a warm-up, then the ladder's rates one after
another (or the rungs around an earlier run's knees), each a loadgen Poisson point on the
workload's first requests (a doubtful one drawn a second time, its point then over both draws),
then a wait until the nodes are idle; every point is judged by both SLOs (or by the one SLO a
deployment set up for it is judged by) and goes into the results at once. Beside what the router
and nodes say of a point (bench/gpu/goodput_signals.py), each point and draw keeps the bench's own
side of it (bench/gpu/goodput_host.py): `client_load`, the load generator's CPU cores, event-loop
lag and garbage-collector pauses (each point runs on a settled heap, loadgen/heap.py), and
`host_net`, the host's TCP retransmissions and softnet drops over its requests."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.gpu import goodput_plan as plan
from bench.gpu.goodput_host import ClientLoad, host_net, host_net_deltas
from bench.gpu.goodput_report import SLO_NAMES, Results, point_entries, prior_knees
from bench.gpu.goodput_signals import (
    node_count_means,
    node_counter_deltas,
    node_signals,
    node_stage_means_ms,
    node_stage_totals,
    node_step_tails,
    point_router_load,
    point_calibration,
    point_counters,
    point_decisions,
    point_pool,
    router_counters,
)
from bench.gpu.goodput_up import UpProcess, wait_idle
from bench.gpu.goodput_workloads import Workload, fresh_prompts
from loadgen.client import EndpointConfig, make_client, served_model
from loadgen.dataset import BenchRequest
from loadgen.heap import settled_heap
from loadgen.metrics import RequestRecord, stream_stalls
from loadgen.sweep import LoadPoint, arrival_times, run_point

WARMUP = 8  # requests per workload and deployment before its curve: its prompt shapes compiled once
WARMUP_OUTPUT = 16  # tokens each (decode shapes are warm from start-up's graph capture)
DRAIN_S = 30.0  # longest wait for the nodes to go idle between points
REDRAW_SEED_STEP = 7919  # a rate's second draw: its arrivals from seed + this


@dataclass(frozen=True)
class RunSettings:
    ladder: plan.Ladder
    window_s: float  # about this many seconds of arrivals per point
    least: int  # requests per point, at least
    most: int  # and at most
    slos: dict[str, dict[str, float]]  # "loose" and "tight", seconds
    seed: int
    vocab: int  # prompt ids are drawn below it
    # an earlier report whose knees each curve is measured around (plan.Focus), with the step and
    # draws of its rungs; None: the ladder from its start
    around: dict[str, Any] | None = None
    focus: plan.Focus = plan.Focus(())
    # deployments whose knees a curve takes where the earlier report found none of its own, in order
    around_from: tuple[str, ...] = ()


def measure_deployment(
    up: UpProcess,
    deployment: str,
    workloads: list[Workload],
    requests: dict[str, list[BenchRequest]],
    settings: RunSettings,
    budget: plan.Budget,
    results: Results,
    out_dir: Path,
    gpu: str,
    judged: str | None = None,
) -> None:
    """Every workload's curve on this deployment; results written after each curve. `judged`: the
    one SLO its points count for (a deployment whose guard was set from that SLO), None: both."""

    async def run() -> None:
        endpoint = EndpointConfig(up.url, "")  # each request carries its own time limit
        async with make_client(endpoint, settings.most + WARMUP) as client:
            endpoint = replace(endpoint, model=await served_model(client))
            for w in workloads:
                end = budget.curve_end(time.monotonic())
                ended = await _curve(
                    client, endpoint, up, deployment, w, requests[w.name], settings, end, results, judged
                )
                results.curve(w.name, deployment, ended=ended)
                budget.curve_done()
                results.write(out_dir, gpu)

    asyncio.run(run())


async def _curve(
    client: httpx.AsyncClient,
    endpoint: EndpointConfig,
    up: UpProcess,
    deployment: str,
    workload: Workload,
    requests: list[BenchRequest],
    settings: RunSettings,
    end: float,
    results: Results,
    judged: str | None,
) -> str:
    """One deployment's curve for one workload, until the ladder is done or `end`; returns why it ended."""
    metrics = list(up.metrics.values())
    salt = f"{deployment}:{workload.name}:{settings.seed}"
    warm = [replace(r, output_len=min(r.output_len, WARMUP_OUTPUT), timeout_s=None) for r in requests[:WARMUP]]
    warm = fresh_prompts(warm, f"{salt}:warm-up", settings.vocab)
    records, _ = await run_point(client, endpoint, warm, LoadPoint("concurrency", 4))
    results.curve(workload.name, deployment, warmup_failed=sum(not r.ok for r in records))
    await wait_idle(client, metrics, DRAIN_S)
    done: dict[float, plan.Measured] = {}
    drawn: dict[float, tuple[list[RequestRecord], float]] = {}  # rate -> every draw's records, wall
    ladder = plan.curve_ladder(settings.ladder, both_slos=judged is None)
    focus = curve_focus(settings, workload.name, deployment, judged)
    if focus is not None:
        # the knees it was measured around, and whose they were where not its own
        of = {"focus_of": focus.of} if focus.of else {}
        results.curve(workload.name, deployment, focus=list(focus.knees), **of)
    tail_s = max(r.timeout_s or 0.0 for r in requests[:WARMUP])  # the worst case, until a point is seen
    redrawn = sent = 0  # second draws, and points sent (each draws prompts of its own)
    while True:
        rate = next_rate(ladder, focus, list(done.values()), redrawn, judged)
        if rate is None:
            break
        if not up.alive():
            raise RuntimeError(f"`pdserve up` ({deployment}) exited:\n{up.log_tail()}")
        n = plan.requests_at(rate, settings.window_s, settings.least, settings.most)
        if time.monotonic() + plan.point_estimate_s(n, rate, tail_s) > end:
            return "time budget"
        draw = done[rate].draws if rate in done else 0
        # the same arrivals for both deployments at a rate and draw
        seed = settings.seed + round(rate * 1000) + draw * REDRAW_SEED_STEP
        sent += 1
        records, wall, extra = await _point(
            client, endpoint, up, metrics, requests[:n], rate, seed, f"{salt}:{sent - 1}", settings.vocab
        )
        tail_s = max(0.0, wall - arrival_times(n, rate, seed)[-1])
        earlier, earlier_wall = drawn.get(rate, ([], 0.0))
        drawn[rate] = (earlier + records, earlier_wall + wall)
        entries = judged_entries(point_entries(deployment, rate, *drawn[rate], settings.slos), judged)
        alone = judged_entries(point_entries(deployment, rate, records, wall, settings.slos), judged)
        this_draw = draw_summary(seed, alone, extra)
        if draw:
            redrawn += 1
            results.merge_draw(workload.name, deployment, rate, entries, this_draw)
        else:
            results.add_point(workload.name, entries, **extra, draws=[this_draw])
        done[rate] = measured(rate, entries, draw + 1)
        judged_by = " ".join(f"{slo} {e['attainment']:.0%}" for slo, e in entries.items())
        print(
            f"[goodput] {deployment} {workload.name} {rate:g} req/s x {n}"
            f"{f' (draw {draw + 1})' if draw else ''}: attainment {judged_by} ({wall:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    if focus is not None:
        return "focus done"
    return "max points" if len(done) >= ladder.max_points else "ladder done"


async def _point(
    client: httpx.AsyncClient,
    endpoint: EndpointConfig,
    up: UpProcess,
    metrics: list[str],
    requests: list[BenchRequest],
    rate: float,
    seed: int,
    salt: str,
    vocab: int,
) -> tuple[list[RequestRecord], float, dict[str, Any]]:
    """One Poisson draw of `requests` at `rate`, between idle deployments: its records, wall time
    and what the router and the nodes said of it, with the client's own load (`client_load`) and
    the host's TCP retransmissions and packet drops (`host_net`) while it ran."""
    split_wait_s = await wait_split(client, up.url, DRAIN_S)
    router_before, nodes_before = await router_counters(client, up.url), await node_stage_totals(client, up.metrics)
    sent = fresh_prompts(requests, salt, vocab)  # prompt ids no earlier point sent
    # the bench's own side, over the point's requests alone: its loop and core, the host's TCP resends
    with settled_heap():  # settled before the client's figures start: they count the point's own pauses
        net_before, client_load = host_net(), ClientLoad.start()
        records, wall = await run_point(client, endpoint, sent, LoadPoint("rate", rate), seed=seed)
        client_figures, net = await client_load.stop(), host_net_deltas(net_before, host_net())
    nodes = await node_signals(client, up.metrics)  # the last seconds of the point's load
    router_after = await router_counters(client, up.url)
    paths, stages = point_counters(router_before, router_after)
    reasons, estimates = point_decisions(router_before, router_after)
    nodes_after = await node_stage_totals(client, up.metrics)
    drained = await wait_idle(client, metrics, DRAIN_S)
    return (
        records,
        wall,
        {
            "drained": drained,
            "split_wait_s": split_wait_s,
            "nodes": nodes,
            "paths": paths,
            "path_reasons": reasons,
            "path_estimates_ms": estimates,
            "path_calibration": point_calibration(router_after),
            "pool": point_pool(router_after),
            "ttft_stages_ms": stages,
            "node_stages_ms": node_stage_means_ms(nodes_before, nodes_after),
            "node_means": node_count_means(nodes_before, nodes_after),
            "node_counts": node_counter_deltas(nodes_before, nodes_after),
            "node_step_tails": node_step_tails(nodes_before, nodes_after),
            "stream_stalls": stream_stalls(records),
            "router_load": point_router_load(router_before, router_after),
            "client_load": client_figures,
            "host_net": net,
        },
    )


def curve_focus(settings: RunSettings, workload: str, deployment: str, judged: str | None) -> plan.Focus | None:
    """The knees this curve is measured around, or None (no earlier report, or no knee in it):
    its own, else those of the first of `around_from` the earlier report found any for (a new
    deployment measured around a like one's knees: pd_always_pooled around colocated's)."""
    if settings.around is None:
        return None
    slos = [judged] if judged else SLO_NAMES
    if knees := prior_knees(settings.around, workload, deployment, slos):
        return replace(settings.focus, knees=knees)
    for other in settings.around_from:
        if knees := prior_knees(settings.around, workload, other, slos):
            return replace(settings.focus, knees=knees, of=other)
    return None


def next_rate(
    ladder: plan.Ladder, focus: plan.Focus | None, done: list[plan.Measured], redrawn: int, judged: str | None
) -> float | None:
    """The curve's next rate: around its earlier knees when it has them, else a doubtful rate's
    second draw or the ladder's next rung."""
    if focus is not None:
        return plan.focused_next(ladder, focus, done, [judged] if judged else SLO_NAMES)
    again = plan.redraw(ladder, done, redrawn)
    return again if again is not None else plan.next_rate(ladder, done)


def draw_summary(seed: int, entries: dict[str, dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any]:
    """What a point keeps of each of its draws: the seed, attainment and latency by SLO, paths,
    stalls and the loads of router, client and host."""
    first = next(iter(entries.values()))
    return {
        "seed": seed,
        "requests": first["requests"],
        "attainment": {slo: e["attainment"] for slo, e in entries.items()},
        "ttft_ms_p90": first["ttft_ms"]["p90"],
        "tpot_ms_p50": first["tpot_ms"]["p50"],
        "paths": extra.get("paths", {}),
        "stream_stalls": extra.get("stream_stalls", {}),  # a stall in one draw is not the other's
        "node_step_tails": extra.get("node_step_tails", {}),
        "router_load": extra.get("router_load", {}),  # a router out of CPU in one draw stalls all its streams
        "client_load": extra.get("client_load", {}),  # so does a client reading its streams late
        "host_net": extra.get("host_net", {}),  # and a dropped loopback segment, for an RTO
    }


def judged_entries(entries: dict[str, dict[str, Any]], judged: str | None) -> dict[str, dict[str, Any]]:
    """A point's entries by SLO, kept for the SLO a run is judged by (all of them for None)."""
    return entries if judged is None else {judged: entries[judged]}


def measured(rate: float, entries: dict[str, dict[str, Any]], draws: int = 1) -> plan.Measured:
    """What the ladder reads of a point. A run judged by one SLO steps both of the ladder's
    brackets on it, so its curve sharpens that SLO's knee alone."""
    attained = {slo: entry["attainment"] for slo, entry in entries.items()}
    if not attained:
        raise ValueError("a point is judged by at least one SLO")
    only = next(iter(attained.values()))
    return plan.Measured(rate, attained.get("loose", only), attained.get("tight", only), draws)


async def wait_split(client: httpx.AsyncClient, router_url: str, timeout_s: float) -> float:
    """Wait (bounded) until a pooling router is split again; returns the seconds waited. A point
    after an overloaded one otherwise starts pooled on the last point's load: on two H100s a
    decode_heavy point at 22.6 req/s ran its first seconds pooled after one at 64 (nineteenth run)."""
    start = time.monotonic()
    while (await router_counters(client, router_url)).get("pool:pooled", 0.0) > 0:
        if time.monotonic() - start > timeout_s:
            break
        await asyncio.sleep(0.25)
    return time.monotonic() - start
