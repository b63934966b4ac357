"""What a goodput point reads from a deployment's /metrics: every node's load against capacity, its
queue, prompt and handoff stages, counts (page runs, eager forwards, mixed steps, kernel compiles,
CPU), its slowest steps and event-loop lag, and the router's requests by path, path decisions, TTFT
stages, calibration, pooling, CPU and event-loop lag, as before/after snapshots whose differences
are the point's."""

from __future__ import annotations

import re
import time
from typing import Collection, Mapping

import httpx

# what each node says of its load against capacity at a point's end (engine/service/metrics.py)
SIGNALS = (
    "pdserve_node_prompt_tokens_per_second",
    "pdserve_node_prefill_capacity_tokens_per_second",
    "pdserve_node_mixed_prefill_tokens_per_second",
    "pdserve_node_decode_tokens_per_second",
    "pdserve_node_decode_capacity_tokens_per_second",
    "pdserve_node_stream_interval_tokens",  # tokens a message (--stream-interval auto: from the rate)
    "pdserve_node_streamed_tokens_per_second",  # the streamed token rate the interval was read from
)
TTFT_STAGES = "pdserve_router_ttft_stage_seconds"  # the router's time to first token by stage
ROUTER_TTFT = "pdserve_router_time_to_first_token_seconds"  # the whole, as the router sees it
PATH_DECISIONS = "pdserve_router_prefill_path_decisions_total"  # by reason (router/prefill_path.py)
PATH_ESTIMATES = "pdserve_router_prefill_path_estimate_seconds"  # each path's estimate when chosen
CALIBRATION = "pdserve_router_ttft_estimate_ratio"  # per node: observed over estimated TTFT
POOLED = "pdserve_router_pd_pooled"  # 1 while every PD node serves whole requests (router/pooling.py)
TIER_LOAD = "pdserve_router_tier_load"  # the recent load over capacity it decides on, by tier
STEP_LINE = "pdserve_router_decode_step_line_seconds"  # the decode step line those loads are priced on
ROUTER_LOOP_LAG = "pdserve_router_event_loop_lag_seconds"  # how late its event loop ran (common/loop_lag.py)
PROCESS_CPU = "process_cpu_seconds_total"  # a process's CPU time (prometheus_client's process collector)
ROUTER_STREAM_INTERVAL = "pdserve_router_stream_interval_tokens"  # the router's own pacing (router/attempt.py)
LAG_OVER_S = 0.05  # a bucket bound of the lag histograms: a loop that late held every stream it relays
_SAMPLE = re.compile(r"^((?:pdserve|process)_\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$", re.M)


def samples(text: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample in a Prometheus exposition."""
    return [(m[1], m[2] or "", float(m[3])) for m in _SAMPLE.finditer(text)]


async def node_signals(client: httpx.AsyncClient, metrics: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per node, the load-against-capacity gauges now (the last 10 s for the rates)."""
    out: dict[str, dict[str, float]] = {}
    for node, url in metrics.items():
        try:
            resp = await client.get(url)
            resp.raise_for_status()
        except httpx.HTTPError:
            continue  # a node that does not answer now has no figures for this point
        found = {name.removeprefix("pdserve_node_"): v for name, _, v in samples(resp.text) if name in SIGNALS}
        out[node] = found
    return out


NODE_STAGES = (
    "pdserve_node_queue_time_seconds",  # admission wait
    "pdserve_node_prompt_seconds",  # admission to first token
    "pdserve_kv_handoff_tail_seconds",  # a prefill's last chunk computed -> final write done
    "pdserve_kv_handoff_stage_seconds",  # that tail by stage (handover includes a late destination)
    "pdserve_kv_transfer_seconds",  # prefill: final write posted -> done; decode: destination sent -> KV landed
    "pdserve_node_launch_seconds",  # host time to launch a batch, by kind (prompt, mixed, decode)
    "pdserve_node_step_seconds",  # the time a batch is charged, by kind: a mixed step against a decode step
    "pdserve_node_event_loop_lag_seconds",  # how late the node's event loop (its gRPC streams) ran
)
# a decode's page runs per prompt written to it; a prefill's runs per write (both sides consecutive)
NODE_COUNTS = ("pdserve_kv_destination_runs", "pdserve_kv_write_runs")
# counted per point: forwards replayed or eager (by reason), decode steps that carried a chunk,
# Triton kernels compiled meanwhile (by kernel; each stalled a step) and their seconds
NODE_COUNTERS = (
    "pdserve_node_graph_forwards_total",
    "pdserve_node_mixed_steps_total",
    "pdserve_node_kernel_compiles_total",
    "pdserve_node_kernel_compile_seconds_total",
    PROCESS_CPU,  # the node process's CPU seconds (all its threads)
)
# the step histogram's buckets, kept per point: a mean hides one step that held a node for seconds
STEP_BUCKETS = "pdserve_node_step_seconds_bucket"
SLOW_STEP_S = 0.1  # a bucket bound of the step histogram (engine/scheduler/stats.py, STEP_BUCKETS)


async def node_stage_totals(client: httpx.AsyncClient, metrics: dict[str, str]) -> dict[str, float]:
    """Every node's queue and prompt histogram totals, keyed `<node>:<sample>` (nodes that do not
    answer are left out); `node_stage_means_ms` of two of them gives a point's means."""
    out: dict[str, float] = {}
    for node, url in metrics.items():
        try:
            resp = await client.get(url)
            resp.raise_for_status()
        except httpx.HTTPError:
            continue
        out.update({f"{node}:{key}": v for key, v in histogram_totals(resp.text, NODE_STAGES + NODE_COUNTS).items()})
        out.update(
            {f"{node}:{n}{{{labels}}}": v for n, labels, v in samples(resp.text) if n in (*NODE_COUNTERS, STEP_BUCKETS)}
        )
    return out


def node_step_tails(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, dict[str, dict[str, float]]]:
    """Per node and step kind, between two snapshots of node_stage_totals: the steps slower than
    SLOW_STEP_S (`slow`) and the lower bound of the highest bucket any step reached
    (`longest_at_least_ms`); kinds without a step are left out."""
    grown: dict[tuple[str, str], dict[float, float]] = {}
    for key, value in after.items():
        node, _, sample = key.partition(":")
        name, _, labels = sample.partition("{")
        if name != STEP_BUCKETS or not (le := re.search(r'le="([^"]*)"', labels)):
            continue
        kind = label_values(re.sub(r'le="[^"]*",?', "", labels))
        grown.setdefault((node, kind), {})[float(le[1])] = value - before.get(key, 0.0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (node, kind), cumulative in grown.items():
        bounds = sorted(cumulative)
        total = cumulative[bounds[-1]]  # the +Inf bucket
        if total <= 0:
            continue
        # a bucket (lo, hi] that grew holds a step at least lo long
        grew = [lo for lo, hi in zip([0.0, *bounds], bounds) if cumulative[hi] > cumulative.get(lo, 0.0)]
        reached = max(grew, default=0.0)
        out.setdefault(node, {})[kind] = {
            "steps": total,
            "slow": total - cumulative.get(SLOW_STEP_S, total),
            "longest_at_least_ms": reached * 1e3,
        }
    return out


def node_count_means(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per node, the mean observation of each of its NODE_COUNTS histograms between two snapshots
    of node_stage_totals (e.g. a decode's page runs per prompt), keyed less `pdserve_`."""
    out: dict[str, dict[str, float]] = {}
    for key, mean in histogram_means(before, after).items():
        node, _, sample = key.partition(":")
        name, _, labels = sample.partition("{")
        if name in NODE_COUNTS:
            short = name.removeprefix("pdserve_")
            out.setdefault(node, {})[f"{short}:{v}" if (v := label_values(labels)) else short] = mean
    return out


def label_values(labels: str) -> str:
    """A sample's non-empty label values beyond its node's own (role, node), comma-joined."""
    return ",".join(v for k, v in re.findall(r'(\w+)="([^"]*)"', labels) if v and k not in ("role", "node"))


def node_stage_means_ms(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per node, the mean milliseconds of each of its NODE_STAGES between two snapshots, keyed by
    the histogram's name less `pdserve_(node_)` and, for one labelled by more than its node,
    `:<label values>`."""
    out: dict[str, dict[str, float]] = {}
    for key, ms in histogram_means_ms(before, after).items():
        node, sample = key.split(":", 1)
        name, _, labels = sample.partition("{")
        values = label_values(labels)  # the node's own labels (role, node) say nothing the key does not
        stage = name.removeprefix("pdserve_node_").removeprefix("pdserve_")
        out.setdefault(node, {})[f"{stage}:{values}" if values else stage] = ms
    return out


def histogram_totals(text: str, names: Collection[str]) -> dict[str, float]:
    """The `_sum` and `_count` samples of the named histograms (`<name>_sum{labels}`: seconds)."""
    return {
        f"{name}{{{labels}}}": value
        for name, labels, value in samples(text)
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in names
    }


def histogram_means(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Mean observation of each histogram between two snapshots of histogram_totals, keyed by its
    `_sum` key less `_sum`; none where nothing was observed."""
    out = {}
    for key, total in after.items():
        if "_sum{" in key:
            count = key.replace("_sum{", "_count{")
            if (n := after.get(count, 0.0) - before.get(count, 0.0)) > 0:
                out[key.replace("_sum{", "{")] = (total - before.get(key, 0.0)) / n
    return out


def histogram_means_ms(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Mean milliseconds per observation of each `*_seconds` histogram between two snapshots of
    histogram_totals, keyed by name (less `_seconds`) and labels; none where nothing was observed."""
    return {
        key.replace("_seconds{", "{"): 1e3 * mean
        for key, mean in histogram_means(before, after).items()
        if "_seconds{" in key
    }


async def router_counters(client: httpx.AsyncClient, router_url: str) -> dict[str, float]:
    """The router's counters so far: requests by prefill path (`path:<name>`) and reason
    (`reason:<name>`), the TTFT stages' histogram totals (histogram_totals), and each node role's
    calibration (`calibration:<role>`); empty if it did not answer."""
    try:
        resp = await client.get(f"{router_url.rstrip('/')}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError:
        return {}
    counts = histogram_totals(resp.text, (TTFT_STAGES, ROUTER_TTFT, PATH_ESTIMATES, ROUTER_LOOP_LAG))
    counts["clock:router"] = time.monotonic()  # when read: its CPU seconds per second of the point
    for name, labels, value in samples(resp.text):
        if name == "pdserve_router_prefill_path_total" and (path := re.search(r'path="([^"]*)"', labels)):
            counts[f"path:{path[1]}"] = value
        elif name == PATH_DECISIONS and (reason := re.search(r'reason="([^"]*)"', labels)):
            counts[f"reason:{reason[1]}"] = value
        elif name == CALIBRATION and (role := re.search(r'role="([^"]*)"', labels)):
            counts[f"calibration:{role[1]}"] = value  # a gauge: read at the point's end, not diffed
        elif name == POOLED:  # gauges too (router/pooling.py)
            counts["pool:pooled"] = value
        elif name == TIER_LOAD and (tier := re.search(r'tier="([^"]*)"', labels)):
            counts[f"pool:load_{tier[1]}"] = value
        elif name == STEP_LINE and (part := re.search(r'part="([^"]*)"', labels)):
            counts[f"pool:line_{part[1]}_ms"] = value * 1e3  # what the loads were priced on
        elif name == PROCESS_CPU:
            counts["cpu:router"] = value
        elif name == ROUTER_STREAM_INTERVAL:  # a gauge: what the router asked of new requests lately
            counts["stream:interval"] = value
        elif name == f"{ROUTER_LOOP_LAG}_bucket" and f'le="{LAG_OVER_S}"' in labels:
            counts["lag:within"] = value  # wake-ups at most LAG_OVER_S late; the total is the _count
    return counts


def point_router_load(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How busy the router's one event loop was between two router_counters snapshots: the CPU
    cores its process used (1.0: a core the whole time, the most its loop can have), its mean
    event-loop lag and the wake-ups more than LAG_OVER_S late, and the tokens a message it asked of
    new requests at the end; empty where it exported none of them."""
    out: dict[str, float] = {}
    wall = after.get("clock:router", 0.0) - before.get("clock:router", 0.0)
    if "cpu:router" in after and "cpu:router" in before and wall > 0:
        out["cpu_cores"] = (after["cpu:router"] - before["cpu:router"]) / wall
    for key, ms in histogram_means_ms(before, after).items():
        if key.startswith(ROUTER_LOOP_LAG.removesuffix("_seconds")):
            out["loop_lag_ms_mean"] = ms
    if "stream:interval" in after:  # its pacing (--stream-messages-per-s), as of the point's last window
        out["stream_interval_tokens"] = after["stream:interval"]
    count = next((k for k in after if k.startswith(f"{ROUTER_LOOP_LAG}_count")), None)
    if count is not None and "lag:within" in after:
        grown = after[count] - before.get(count, 0.0)
        out["loop_lags_over_50ms"] = grown - (after["lag:within"] - before.get("lag:within", 0.0))
    return out


def point_pool(after: dict[str, float]) -> dict[str, float]:
    """The router's mode (pooled 1, split 0) and the tiers' recent load at a point's end (router/pooling.py)."""
    return {k.removeprefix("pool:"): v for k, v in after.items() if k.startswith("pool:")}


def point_calibration(after: dict[str, float]) -> dict[str, float]:
    """Each node role's observed over estimated TTFT as the router read it at a point's end (one
    node per role here): a path estimate that misses a fixed cost shows as a ratio far from 1."""
    return {k.removeprefix("calibration:"): v for k, v in after.items() if k.startswith("calibration:")}


def point_decisions(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(path decisions by reason, mean estimated TTFT in ms of each path when chosen) between two
    router_counters snapshots: why the router sent prompts where it did."""
    reasons = {
        k.removeprefix("reason:"): n
        for k, v in after.items()
        if k.startswith("reason:") and (n := v - before.get(k, 0.0)) > 0
    }
    estimates: dict[str, float] = {}
    for key, ms in histogram_means_ms(before, after).items():
        if key.startswith(PATH_ESTIMATES.removesuffix("_seconds")) and (path := re.search(r'path="([^"]*)"', key)):
            estimates[path[1]] = ms
    return reasons, estimates


def point_counters(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(requests by path, mean TTFT stage in ms) between two router_counters snapshots; stage
    "router_total" is the router's whole TTFT (the client's, less HTTP and the client itself)."""
    paths = {k.removeprefix("path:"): v - before.get(k, 0.0) for k, v in after.items() if k.startswith("path:")}
    stages: dict[str, float] = {}
    for key, ms in histogram_means_ms(before, after).items():
        if stage := re.search(r'stage="([^"]*)"', key):
            stages[stage[1]] = ms
        elif key.startswith(ROUTER_TTFT.removesuffix("_seconds")):
            stages["router_total"] = ms
    return paths, stages


def node_counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Per node, how much each of its NODE_COUNTERS grew between two snapshots of
    node_stage_totals, keyed less `pdserve_node_` and `_total`, with its label values beyond the
    node's own (e.g. `graph_forwards:eager,mixed batch larger than its buckets`); zeros left out."""
    out: dict[str, dict[str, float]] = {}
    for key, value in after.items():
        node, _, sample = key.partition(":")
        name, _, labels = sample.partition("{")
        if name not in NODE_COUNTERS or not (grew := value - before.get(key, 0.0)):
            continue
        short = name.removeprefix("pdserve_node_").removesuffix("_total")
        values = label_values(labels)
        out.setdefault(node, {})[f"{short}:{values}" if values else short] = grew
    return out
