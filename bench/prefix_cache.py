"""The prefix cache against `--disable-radix-cache`, colocated and PD, with EAGLE on, in one run.

Each deployment is a real `pdserve up` measured alone, started twice: cache on, then off. Two
workloads run through `pdserve bench` (loadgen) on each:

* multi-turn chat: conversations of `--turns` turns at a fixed concurrency; each turn's prompt is
  the whole history (prompts and the replies the server gave) plus a new message, so history
  grows by about `--turn-input-len` + `--output-len` tokens per turn. Reported: TTFT p50 per turn
  (and over turns 3+), the share of reusable tokens the server reported as cached, and the
  accepted draft length (from the decode or colocated node's counters);
* no reuse: unrelated random prompts, for the cache's cost (output tokens/s with the cache
  against without); on GPUs 480 of them at concurrency 16, about 10 s of saturated serving per
  start, since a few seconds at concurrency 4 swung by 10% between runs of the same code.

Each workload also records the router's requests by path and the mean of every TTFT stage: the
router's, each node role's queue and prompt time, and a prefill's handoff tail by stage and its
KV write (the goodput bench's NODE_STAGES). PD's router logs every route at debug level, and
each start records `routes` (bench/route_log.py): requests by path and reason, and the remote ones
whose decode held more of their prompt than the prefill, with the tokens recomputed for them.

Ratios compare the two starts of one deployment in this run: TTFT p50 of turns 3+ without the
cache over with it (goal >= 3), reuse (goal >= 0.9), accept length with over without (within
1%), no-reuse throughput with over without (>= 0.97).

On a CPU the built-in pair (EAGLE on) runs it; on GPUs the Llama-3.1-8B-shaped predictable
checkpoint with an echo EAGLE head, whose drafts it nearly always accepts (bench/gpu/goodput_model.py;
the head reads only its input token, so acceptance there checks the draft's tokens and positions,
not its cached hidden states), PD's nodes on two GPUs. Writes
OUT/prefix_cache_<device>.json:
  python -m bench.prefix_cache --out bench/results            # GPUs: about 8 minutes
  python -m bench.prefix_cache --out /tmp/pc --quick           # a CPU smoke
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_report
from bench.common import short_name
from bench.gpu.goodput import gpu_names, prepare_model
from bench.gpu.goodput_signals import (
    NODE_STAGES,
    PATH_DECISIONS,
    PATH_ESTIMATES,
    ROUTER_TTFT,
    TTFT_STAGES,
    histogram_means_ms,
    histogram_totals,
    samples,
)
from bench.gpu.goodput_up import UpProcess
from bench.route_log import route_summary
from loadgen.runner import BenchOptions, run_bench

TOPOLOGY = {"colocated": ("--colocated", "1"), "pd": ("--prefill", "1", "--decode", "1")}
# PD's router weighs each path by what its node caches: a follow-up turn may run on the decode node
# that holds the conversation (its prompts and replies), where the prefill node holds only prompts
PD_FLAGS = ("--pd-prefill-policy", "auto")
NODES = {"colocated": 1, "pd": 2}
START_TIMEOUT_S = 900.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--deployments", default="colocated,pd")
    p.add_argument("--conversations", type=int, default=None, help="multi-turn conversations per run")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-input-len", type=int, default=None, help="tokens of each new message")
    p.add_argument("--output-len", type=int, default=None, help="tokens of each reply")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer, shorter conversations (a smoke run)")
    p.add_argument("--log-dir", type=Path, default=None)
    return p.parse_args(argv)


def sizes(args: argparse.Namespace, gpu: bool) -> dict[str, int]:
    """Lengths by device: on GPUs about 2K tokens of history growth over 10 turns, and a no-reuse
    run long and busy enough for a throughput ratio."""
    base = {"conversations": 8, "turn_input_len": 160, "output_len": 48} if gpu else {}
    base = base or {"conversations": 4, "turn_input_len": 48, "output_len": 16}
    if args.quick:
        base = {"conversations": 2, "turn_input_len": 24, "output_len": 8}
    given = {"conversations": args.conversations, "turn_input_len": args.turn_input_len, "output_len": args.output_len}
    size = {**base, **{k: v for k, v in given.items() if v is not None}}
    busy = gpu and not args.quick
    size["no_reuse_prompts"] = 480 if busy else size["conversations"] * args.turns
    size["no_reuse_concurrency"] = 16 if busy else args.concurrency
    return size


SPEC = ("pdserve_spec_accepted_tokens_total", "pdserve_spec_verifies_total")
# where a first token's time goes: the router's stages, each node role's queue and prompt time, and
# a prefill's handoff tail by stage and its KV write
# and the router's estimate of each path when chosen, and its whole TTFT (from the request's arrival,
# so it less its stages is the router's own parsing, templating and tokenizing)
STAGES = (TTFT_STAGES, *NODE_STAGES, PATH_ESTIMATES, ROUTER_TTFT)
PATHS = "pdserve_router_prefill_path_total"  # requests by prefill path (remote, local, ...)
# what the path decision read at a phase's end: each node's TTFT calibration and prompt capacity
GAUGES = ("pdserve_router_ttft_estimate_ratio", "pdserve_node_prefill_capacity_tokens_per_second")


def counters(router_url: str, metrics_urls: dict[str, str]) -> Counter[str]:
    """Speculation's counters (decode and colocated nodes), the TTFT stages' histogram totals and the
    router's requests by path (`path:<name>`), summed over the router and the nodes now."""
    out: Counter[str] = Counter()
    for url in [f"{router_url}/metrics", *metrics_urls.values()]:
        text = httpx.get(url, timeout=10).text
        out.update(histogram_totals(text, STAGES))
        for name, labels, value in samples(text):
            if name in SPEC and 'role="prefill"' not in labels:
                out[name] += value
            elif name == PATHS and (path := re.search(r'path="([^"]*)"', labels)):
                out[f"path:{path[1]}"] += value
            elif name == PATH_DECISIONS and (reason := re.search(r'reason="([^"]*)"', labels)):
                out[f"reason:{reason[1]}"] += value
            elif name in GAUGES:
                out[f"gauge:{name.removeprefix('pdserve_')}{{{labels}}}"] = value
    return out


def phase(before: Counter[str], after: Counter[str]) -> dict[str, Any]:
    """Between two snapshots of `counters`: requests by path and by the reason for it, and each
    stage's mean in ms."""
    grown = {k: after[k] - before[k] for k in after if k.startswith(("path:", "reason:")) and after[k] > before[k]}
    paths = {k.removeprefix("path:"): n for k, n in grown.items() if k.startswith("path:")}
    reasons = {k.removeprefix("reason:"): n for k, n in grown.items() if k.startswith("reason:")}
    gauges = {k.removeprefix("gauge:"): v for k, v in after.items() if k.startswith("gauge:")}
    return {"paths": paths, "path_reasons": reasons, "gauges": gauges, "stages_ms": histogram_means_ms(before, after)}


def bench_options(url: str, out: Path, args: argparse.Namespace, size: dict[str, int], reuse: bool) -> BenchOptions:
    common: dict[str, Any] = {
        "base_url": url,
        "concurrency": str(args.concurrency),
        "output_len": size["output_len"],
        "range_ratio": 0.0,
        "seed": args.seed,
        "out": out,
        "plots": False,
        "progress": False,
        "timeout": 600.0,
    }
    if reuse:
        return BenchOptions(
            workload="multi-turn",
            num_prompts=size["conversations"],
            turns=args.turns,
            input_len=size["turn_input_len"],
            turn_input_len=size["turn_input_len"],
            **common,
        )
    common["concurrency"] = str(size["no_reuse_concurrency"])
    return BenchOptions(
        num_prompts=size["no_reuse_prompts"],
        input_len=size["turn_input_len"] * args.turns // 2,  # about the multi-turn prompts' mean length
        **common,
    )


def measure(up: UpProcess, args: argparse.Namespace, size: dict[str, int], work: Path) -> dict[str, Any]:
    """Both workloads on a started deployment: the multi-turn figures, acceptance, no-reuse throughput."""
    before = counters(up.url, up.metrics)
    chat, _ = run_bench(bench_options(up.url, work / "multi", args, size, reuse=True), progress=False)
    after = counters(up.url, up.metrics)
    accepted, verifies = (after[k] - before[k] for k in SPEC)
    plain, _ = run_bench(bench_options(up.url, work / "plain", args, size, reuse=False), progress=False)
    done = counters(up.url, up.metrics)
    m, p = chat["points"][0]["metrics"], plain["points"][0]["metrics"]
    turns = {
        k: {"ttft_ms_p50": g["ttft_ms"]["median"], "reuse_ratio": g["reuse_ratio"]} for k, g in m["by_turn"].items()
    }
    return {
        "multi_turn": {
            "requests": m["completed"],
            "failed": m["failed"],
            "by_turn": turns,
            "prefix_cache": m["prefix_cache"],
            "accept_length": 1 + accepted / verifies if verifies > 0 else None,
            "ttft_stages_ms": histogram_means_ms(before, after),
            **{k: v for k, v in phase(before, after).items() if k != "stages_ms"},
        },
        "no_reuse": {"output_throughput": p["output_throughput"], "failed": p["failed"], **phase(after, done)},
    }


def ratios(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """The goals' figures: cache on against off in one deployment."""
    t_on, t_off = on["multi_turn"]["by_turn"]["3+"]["ttft_ms_p50"], off["multi_turn"]["by_turn"]["3+"]["ttft_ms_p50"]
    a_on, a_off = on["multi_turn"]["accept_length"], off["multi_turn"]["accept_length"]
    return {
        "ttft_p50_turn3plus_speedup": t_off / t_on if t_on and t_off else None,
        "reuse_ratio": on["multi_turn"]["prefix_cache"]["reuse_ratio"],
        "accept_length_ratio": a_on / a_off if a_on and a_off else None,
        "no_reuse_throughput_ratio": on["no_reuse"]["output_throughput"] / off["no_reuse"]["output_throughput"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = gpu_names()
    device = gpus[0] if gpus else "cpu"
    gpu = bool(gpus)
    model_flags: list[str] = []
    if gpu:  # the 8B shape with an echo EAGLE head; on a CPU the built-in pair (EAGLE on)
        model, spec = prepare_model("llama8b", None, eagle=True)
        model_flags = ["--model", str(model), *spec, "--no-isolate-gpus", "--device", "auto"]
    size = sizes(args, gpu)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-prefix-logs-"))
    data: dict[str, Any] = {"device": device, "sizes": {**size, "turns": args.turns, "concurrency": args.concurrency}}
    data["command"] = "python -m bench.prefix_cache " + " ".join(argv if argv is not None else sys.argv[1:])
    data["deployments"] = {}
    started = time.monotonic()
    for dep in [d for d in args.deployments.split(",") if d]:
        runs: dict[str, Any] = {}
        for state in ("cache", "no_cache"):
            argv_up = [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", "--verbose", *TOPOLOGY[dep]]
            argv_up += list(PD_FLAGS) if dep == "pd" else []
            argv_up += model_flags
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if dep == "pd":  # the router logs each request's path, its reason and each node's expected hit
                env["PDSERVE_LOG_LEVEL"] = "debug"
            if state == "no_cache":
                env["PDSERVE_DISABLE_RADIX_CACHE"] = "true"  # every node's --disable-radix-cache
            log_path = log_dir / f"{dep}-{state}.log"
            with UpProcess(dep, argv_up, env, log_path, nodes=NODES[dep]) as up:
                up.start(timeout_s=START_TIMEOUT_S)
                runs[state] = measure(up, args, size, Path(tempfile.mkdtemp(prefix=f"pc-{dep}-{state}-")))
            if dep == "pd":  # both workloads' routes, from the router's debug lines
                runs[state]["routes"] = route_summary(log_path.read_text(errors="replace"))
            print(f"[prefix-cache] {dep} {state}: {runs[state]['multi_turn']['by_turn'].get('3+')}", file=sys.stderr)
        runs["ratios"] = ratios(runs["cache"], runs["no_cache"])
        data["deployments"][dep] = runs
        write_report(args.out / f"prefix_cache_{short_name(device)}.json", data)
    data["wall_s"] = time.monotonic() - started
    path = args.out / f"prefix_cache_{short_name(device)}.json"
    write_report(path, data)
    for dep, runs in data["deployments"].items():
        print(dep, runs["ratios"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
