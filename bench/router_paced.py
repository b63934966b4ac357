"""The router's CPU per request under paced, open-loop PD streams, by tokens per message.

Run: `python -m bench.router_paced [--quick] [--rate R] [--seconds S] [--budget M] [--event-loop L]
[--out PATH]`.
Instant fake prefill + decode nodes (`bench.router_nodes`) stream each request's tokens in messages
of K tokens, 10 ms a token apart (a decode step's pace), so dozens of streams are open at once as in
serving; the real router process fronts them on 127.0.0.1, its own pacing off
(`--stream-messages-per-s 0`). Poisson arrivals at R req/s of 1,024-token prompts (as ids) asking
for 256 tokens. For each K the router's CPU seconds per request, and per thread, are read from
/proc; a least-squares line through (messages per request, CPU per request) splits the cost into a
part per request and a part per message: what `--stream-interval` can save and what it cannot.
A last level runs nodes at one token a message with the router pacing them within M messages a
second (its `--stream-messages-per-s`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_report
from bench.engine_cpu import _cpu_model, _loadavg, _nproc
from bench.router_overhead import Proc, cpu_seconds, summary_ms
from common.defaults import DEFAULT_ROUTER_STREAM_MESSAGES_PER_S

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "router_paced.json"
PROMPT_TOKENS, OUTPUT_TOKENS, TOKEN_INTERVAL_MS = 1024, 256, 10.0
FULL = {"rate": 30.0, "seconds": 12.0, "per_message": (1, 2, 4, 8, 32)}
QUICK = {"rate": 10.0, "seconds": 2.0, "per_message": (1, 32)}
WARMUP = 20


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid`, keyed by thread id and name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


async def one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[float | None, bool]:
    """One streaming completion; (seconds to its first data line, whether it ended with [DONE])."""
    start, first, done = time.perf_counter(), None, False
    body = {"model": "bench-model", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "stream": True}
    async with client.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter() - start
            done = done or line.strip() == "data: [DONE]"
    return first, done and resp.status_code == 200


async def poisson(
    url: str, rate: float, n: int, seed: int, asked: list[float] | None = None
) -> list[tuple[float | None, bool]]:
    """`n` requests at Poisson arrivals; with `asked`, the router's stream interval gauge is read
    into it at every arrival of a request, while they come."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    metrics_url = url.replace("/v1/completions", "/metrics")
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        tasks, at = [], time.perf_counter()
        for i in range(n):
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            prompt = [rng.randrange(10, 500) for _ in range(PROMPT_TOKENS)]
            tasks.append(asyncio.create_task(one(client, url, prompt)))
            if asked is not None and i % max(1, round(rate / 4)) == 0:  # about four reads a second
                value = _gauge((await client.get(metrics_url)).text, "pdserve_router_stream_interval_tokens")
                asked.append(value if value is not None else 0.0)
        return list(await asyncio.gather(*tasks))


def measure_level(
    model: Path, tmp: Path, per_message: int, rate: float, seconds: float, budget: float = 0.0, loop: str = "auto"
) -> dict[str, Any]:
    """Nodes streaming `per_message` tokens a message and a router pacing them within `budget`
    messages a second (0: not at all), one Poisson run; both stopped."""
    node_args = ["--tokens-per-chunk", str(per_message), "--token-interval-ms", str(TOKEN_INTERVAL_MS)]
    name = f"{per_message}-{budget:g}"
    nodes = Proc(["bench.router_nodes", "--tokenizer", str(model), *node_args], tmp / f"nodes{name}.log")
    router = None
    try:
        router_args = ["--port", "0", "--prefill", f"{nodes.addrs['prefill']},9100", "--decode", nodes.addrs["decode"]]
        router_args += ["--stream-messages-per-s", f"{budget:g}", "--event-loop", loop]
        router = Proc(["pdserve.cli", "router", *router_args], tmp / f"router{name}.log")
        url = f"http://{router.addrs['http']}/v1/completions"
        asyncio.run(poisson(url, rate, WARMUP, seed=1))
        pid, n = router.proc.pid, round(rate * seconds)
        threads0, cpu0, wall0 = thread_cpu(pid), cpu_seconds(pid), time.perf_counter()
        asked: list[float] = []
        results = asyncio.run(poisson(url, rate, n, seed=2, asked=asked if budget else None))
        cpu, wall, threads1 = cpu_seconds(pid) - cpu0, time.perf_counter() - wall0, thread_cpu(pid)
        metrics = httpx.get(f"http://{router.addrs['http']}/metrics", timeout=10).text
    finally:
        if router is not None:
            router.stop()
        nodes.stop()
    by_thread = {k: v - threads0.get(k, 0.0) for k, v in threads1.items()}
    main_thread = sum(v for k, v in by_thread.items() if k.startswith(f"{pid}:"))  # the loop's thread: tid == pid
    return {
        "tokens_per_message": per_message,
        "router_budget_messages_per_s": budget,
        "router_interval_tokens": _gauge(metrics, "pdserve_router_stream_interval_tokens"),
        # what the pacing router asked of new requests, read about four times a second as they came
        "router_interval_asked": asked,
        # paced by the router, a request's messages are whatever it asked for as it started: unknown here
        "messages_per_request": None if budget else -(-OUTPUT_TOKENS // per_message),
        "requests": n,
        "completed": sum(ok for _, ok in results),
        "router_cores": cpu / wall,
        "router_cpu_ms_per_request": 1e3 * cpu / n,
        "event_loop_thread_cpu_ms_per_request": 1e3 * main_thread / n,
        "other_threads_cpu_ms_per_request": 1e3 * (cpu - main_thread) / n,
        "ttft": summary_ms([f for f, _ in results if f is not None]),
    }


def _gauge(metrics: str, name: str) -> float | None:
    """A gauge's value from the router's /metrics text (None when it does not export it)."""
    line = next((ln for ln in metrics.splitlines() if ln.startswith(name + " ")), None)
    return float(line.split()[1]) if line else None


def fit(levels: list[dict[str, Any]]) -> dict[str, float] | None:
    """Least squares: CPU ms per request = per_request + per_message x messages, over the unpaced
    levels (None with fewer than two message counts)."""
    unpaced = [lv for lv in levels if not lv["router_budget_messages_per_s"]]
    xs = [float(lv["messages_per_request"]) for lv in unpaced]
    ys = [float(lv["router_cpu_ms_per_request"]) for lv in unpaced]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"per_request_ms": my - slope * mx, "per_message_ms": slope}


def run(
    quick: bool = False,
    rate: float | None = None,
    seconds: float | None = None,
    per_message: tuple[int, ...] = (),
    budget: float = DEFAULT_ROUTER_STREAM_MESSAGES_PER_S,
    loop: str = "auto",
) -> dict[str, Any]:
    from fixtures.tiny_model import write_tiny_model  # torch: this (client) process only

    cfg = dict(QUICK if quick else FULL)
    rate, seconds = rate or float(cfg["rate"]), seconds or float(cfg["seconds"])
    env = {"cpu": _cpu_model(), "cores": _nproc(), "python": sys.version.split()[0], "loadavg_before": _loadavg()}
    with tempfile.TemporaryDirectory(prefix="pdserve-router-paced-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", "LlamaForCausalLM", seed=0)
        levels = [
            measure_level(model, Path(tmp), k, rate, seconds, loop=loop) for k in per_message or cfg["per_message"]
        ]
        if budget > 0:  # nodes at a token a message, the router pacing them
            levels.append(measure_level(model, Path(tmp), 1, rate, seconds, budget, loop))
    env["loadavg_after"] = _loadavg()
    return {
        "benchmark": "router_paced",
        "rate": rate,
        "seconds": seconds,
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "token_interval_ms": TOKEN_INTERVAL_MS,
        "event_loop": loop,
        "env": env,
        "levels": levels,
        "fit": fit(levels),
    }


def _asked(level: dict[str, Any]) -> str:
    """Tokens a message: the nodes' own, and the mean of what the pacing router asked, if it paced."""
    asked = level["router_interval_asked"]
    own = str(level["tokens_per_message"])
    return f"{own} (router asked {sum(asked) / len(asked):.1f})" if asked else own


def format_table(report: dict[str, Any]) -> str:
    rows = [
        "| tokens a message | router budget (messages/s) | messages a request | completed | router cores "
        "| CPU ms a request (event loop / other threads) | TTFT p50 / p90 ms |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for lv in report["levels"]:
        rows.append(
            f"| {_asked(lv)} | {lv['router_budget_messages_per_s'] or 'off'} "
            f"| {lv['messages_per_request'] or '-'} | {lv['completed']}/{lv['requests']} "
            f"| {lv['router_cores']:.2f} | {lv['router_cpu_ms_per_request']:.2f} "
            f"({lv['event_loop_thread_cpu_ms_per_request']:.2f} / {lv['other_threads_cpu_ms_per_request']:.2f}) "
            f"| {lv['ttft']['p50_ms']:.1f} / {lv['ttft']['p90_ms']:.1f} |"
        )
    if (f := report["fit"]) is not None:
        rows.append(f"\nfit: {f['per_request_ms']:.2f} ms a request + {f['per_message_ms']:.3f} ms a message")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.router_paced", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="two levels, 2 s each at 10 req/s")
    ap.add_argument("--rate", type=float, default=None, help="requests a second (Poisson)")
    ap.add_argument("--seconds", type=float, default=None, help="arrivals per level, in seconds")
    ap.add_argument("--per-message", default="", help="comma-separated tokens a message (default: 1,2,4,8,32)")
    ap.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_ROUTER_STREAM_MESSAGES_PER_S,
        help="the paced level's router --stream-messages-per-s (0: no such level)",
    )
    ap.add_argument("--event-loop", default="auto", help="the router's --event-loop (auto, uvloop or asyncio)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file")
    args = ap.parse_args(argv)
    per_message = tuple(int(k) for k in args.per_message.split(",") if k.strip())
    report = run(args.quick, args.rate, args.seconds, per_message, args.budget, args.event_loop)
    print(format_table(report))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
