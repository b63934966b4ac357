"""The router's own cost: OpenAI streaming /v1/completions -> PD gRPC pair, against instant nodes.

Run: `python -m bench.router_overhead [--quick] [--max-tokens N] [--tokens-per-chunk K] [--out PATH]`.
Fake prefill + decode nodes that answer at once (`bench.router_nodes`, own process) sit behind the
real router process (`python -m pdserve.cli router`), all on 127.0.0.1. Latency: sequential
streaming requests (16 tokens by default, in messages of K) through the router, alternating with
the same call made straight to the nodes over
gRPC (both legs at once, as the router does); router-added = router - direct, per percentile.
Throughput: N concurrent httpx streaming clients for a fixed time, through the router and
straight to the nodes; CPU seconds of the router, nodes and this (client) process are recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pbg

from bench.common import write_report
from bench.engine_cpu import _cpu_model, _loadavg, _nproc
from common.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "router_overhead.json"
PROMPT = (
    "A language model predicts the next token of a sequence from the tokens before it. "
    "Summarise in one sentence why prefill and decode run on different nodes:"
)
MAX_TOKENS, TOKENS_PER_CHUNK = 16, 4
FULL = {"latency_n": 300, "warmup": 30, "levels": (8, 32, 64), "seconds": 10.0}
QUICK = {"latency_n": 20, "warmup": 5, "levels": (8,), "seconds": 1.5}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (psutil if installed, else /proc/<pid>/stat)."""
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except ImportError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Proc:
    """A child process that prints one READY line; output goes to a log file; killed by its own pid."""

    def __init__(self, args: list[str], log: Path, timeout: float = 60.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *args],
                cwd=REPO,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not (ready := [ln for ln in log.read_text().splitlines() if ln.startswith("READY")]):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[0]} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.addrs = dict(kv.split("=", 1) for kv in ready[0].split()[1:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary_ms(xs: list[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "p50_ms": 1e3 * statistics.median(xs),
        "p90_ms": 1e3 * pct(xs, 90),
        "p99_ms": 1e3 * pct(xs, 99),
        "mean_ms": 1e3 * statistics.fmean(xs),
    }


class Clients:
    """The two ways to get `max_tokens` tokens: through the router (HTTP + SSE) or straight to the nodes (gRPC)."""

    def __init__(self, http: str, prefill: str, decode: str, ids: list[int], max_tokens: int = MAX_TOKENS) -> None:
        self.url, self.ids, self.max_tokens = f"http://{http}/v1/completions", ids, max_tokens
        self.body = {
            "model": "bench-model",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.channels = [grpc.aio.insecure_channel(a) for a in (prefill, decode)]
        self.prefill, self.decode = (pbg.SglangSchedulerStub(c) for c in self.channels)
        self.bootstrap_port = 9100

    async def via_router(self, client: httpx.AsyncClient) -> tuple[float, float, int]:
        """(ttft s, e2e s, completion tokens from the usage chunk) of one streaming request."""
        t0 = time.perf_counter()
        ttft, last = 0.0, ""
        async with client.stream("POST", self.url, json=self.body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    e2e = time.perf_counter() - t0
                    return ttft, e2e, json.loads(last[6:])["usage"]["completion_tokens"]
                if line.startswith("data: "):
                    ttft, last = ttft or time.perf_counter() - t0, line
        raise RuntimeError("stream ended without [DONE]")

    async def direct(self) -> tuple[float, float, int]:
        """The same generation straight to the nodes: one GenerateRequest to both legs at once."""
        t0 = time.perf_counter()
        req = pb.GenerateRequest(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            tokenized=pb.TokenizedInput(input_ids=self.ids),
            stream=True,
            sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=self.max_tokens, n=1),
            disaggregated_params=pb.DisaggregatedParams(
                bootstrap_host="127.0.0.1",
                bootstrap_port=self.bootstrap_port,
                bootstrap_room=secrets.randbelow(2**31 - 1) + 1,
            ),
        )

        async def drain_prefill() -> None:
            async for _ in self.prefill.Generate(req):
                pass

        prefill = asyncio.ensure_future(drain_prefill())
        ttft, tokens = 0.0, 0
        async for msg in self.decode.Generate(req):
            if msg.HasField("chunk") and msg.chunk.token_ids:
                ttft = ttft or time.perf_counter() - t0
                tokens += len(msg.chunk.token_ids)
        await prefill
        return ttft, time.perf_counter() - t0, tokens

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels))


async def bench_latency(c: Clients, n: int, warmup: int) -> dict[str, Any]:
    """Sequential requests, router and direct alternating (first mover swapped every round)."""
    out: dict[str, list[float]] = {k: [] for k in ("router_ttft", "router_e2e", "direct_ttft", "direct_e2e", "health")}
    async with httpx.AsyncClient(timeout=30.0) as client:
        health = c.url.replace("/v1/completions", "/health")
        for i in range(warmup + n):
            pair = [("router", lambda: c.via_router(client)), ("direct", c.direct)]
            for name, call in pair if i % 2 == 0 else pair[::-1]:
                ttft, e2e, tokens = await call()
                assert tokens == c.max_tokens, f"{name}: {tokens} tokens"
                if i >= warmup:
                    out[f"{name}_ttft"].append(ttft)
                    out[f"{name}_e2e"].append(e2e)
            t0 = time.perf_counter()
            (await client.get(health)).raise_for_status()
            if i >= warmup:
                out["health"].append(time.perf_counter() - t0)
    res: dict[str, Any] = {k: summary_ms(v) for k, v in out.items()}
    for m in ("ttft", "e2e"):
        r, d = res[f"router_{m}"], res[f"direct_{m}"]
        res[f"added_{m}"] = {k: r[k] - d[k] for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms")}
        res[f"added_{m}"]["paired_p50_ms"] = 1e3 * statistics.median(
            a - b for a, b in zip(out[f"router_{m}"], out[f"direct_{m}"])
        )
    return res


async def bench_throughput(
    call: Callable[[], Awaitable[tuple[float, float, int]]], concurrency: int, seconds: float, pids: dict[str, int]
) -> dict[str, Any]:
    """`concurrency` workers issue requests back to back until `seconds` have passed."""
    e2e: list[float] = []
    tokens, errors = 0, 0

    async def worker(deadline: float) -> None:
        nonlocal tokens, errors
        while time.perf_counter() < deadline:
            try:
                _, t, n = await call()
            except (httpx.HTTPError, grpc.aio.AioRpcError, RuntimeError):
                errors += 1
                continue
            e2e.append(t)
            tokens += n

    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(t0 + seconds) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    res = {
        "concurrency": concurrency,
        "seconds": wall,
        "requests": len(e2e),
        "errors": errors,
        "req_s": len(e2e) / wall,
        "tok_s": tokens / wall,
        "e2e": summary_ms(e2e) if e2e else {},
        "cpu_pct": {k: 100 * v / wall for k, v in cpu.items()},
    }
    res["router_cpu_ms_per_req"] = 1e3 * cpu.get("router", 0.0) / max(1, len(e2e))
    return res


async def measure(c: Clients, cfg: dict[str, Any], pids: dict[str, int]) -> dict[str, Any]:
    latency = await bench_latency(c, cfg["latency_n"], cfg["warmup"])
    rows = []
    for level in cfg["levels"]:
        limits = httpx.Limits(max_connections=level, max_keepalive_connections=level)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
            await asyncio.gather(*(c.via_router(client) for _ in range(level)))  # open the connections
            rows.append(
                {"path": "router", **await bench_throughput(lambda: c.via_router(client), level, cfg["seconds"], pids)}
            )
        rows.append({"path": "direct", **await bench_throughput(c.direct, level, cfg["seconds"], pids)})
    return {"latency": latency, "throughput": rows}


def run(quick: bool = False, tokens_per_chunk: int = TOKENS_PER_CHUNK, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Start nodes + router, measure, stop them; returns the results (nothing printed or written)."""
    # torch: only this (client) process pays for it, not the router or the nodes
    from fixtures.tiny_model import write_tiny_model

    cfg = dict(QUICK if quick else FULL)
    env = {
        "cpu": _cpu_model(),
        "cores": _nproc(),
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "httpx": httpx.__version__,
        "loadavg_before": _loadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-router-bench-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", "LlamaForCausalLM", seed=0)
        nodes = Proc(
            ["bench.router_nodes", "--tokenizer", str(model), "--tokens-per-chunk", str(tokens_per_chunk)],
            Path(tmp) / "nodes.log",
        )
        router = None
        try:
            router = Proc(
                [
                    "pdserve.cli",
                    "router",
                    "--port",
                    "0",
                    "--prefill",
                    f"{nodes.addrs['prefill']},9100",
                    "--decode",
                    nodes.addrs["decode"],
                ],
                Path(tmp) / "router.log",
            )
            ids = Tokenizer.from_dir(model).encode(PROMPT)

            async def go() -> dict[str, Any]:
                c = Clients(router.addrs["http"], nodes.addrs["prefill"], nodes.addrs["decode"], ids, max_tokens)
                try:
                    return await measure(
                        c, cfg, {"router": router.proc.pid, "nodes": nodes.proc.pid, "client": os.getpid()}
                    )
                finally:
                    await c.close()

            results = asyncio.run(go())
        finally:
            if router is not None:
                router.stop()
            nodes.stop()
    env["loadavg_after"] = _loadavg()
    return {
        "benchmark": "router_overhead",
        "quick": quick,
        "max_tokens": max_tokens,
        "tokens_per_chunk": tokens_per_chunk,
        "prompt_tokens": len(ids),
        **{k: cfg[k] for k in cfg},
        "env": env,
        **results,
    }


def format_tables(report: dict[str, Any]) -> str:
    """Two markdown tables: per-request latency, then throughput per concurrency."""
    lat = report["latency"]
    rows = [
        "| sequential streaming request | n | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p90 ms | e2e p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"direct": "direct to the nodes (gRPC, both legs)", "router": "through the router (HTTP + SSE)"}
    for key, name in names.items():
        t, e = lat[f"{key}_ttft"], lat[f"{key}_e2e"]
        rows.append(
            f"| {name} | {e['n']} | {t['p50_ms']:.2f} | {t['p99_ms']:.2f} | {e['p50_ms']:.2f} "
            f"| {e['p90_ms']:.2f} | {e['p99_ms']:.2f} |"
        )
    t, e = lat["added_ttft"], lat["added_e2e"]
    rows.append(
        f"| **router-added** (router - direct) | | **{t['p50_ms']:+.2f}** | {t['p99_ms']:+.2f} "
        f"| **{e['p50_ms']:+.2f}** | {e['p90_ms']:+.2f} | {e['p99_ms']:+.2f} |"
    )
    h = lat["health"]
    rows.append(
        f"| (HTTP round trip floor: GET /health) | {h['n']} | | | {h['p50_ms']:.2f} | {h['p90_ms']:.2f} "
        f"| {h['p99_ms']:.2f} |"
    )
    rows += [
        "",
        (
            "| path | clients | requests | req/s | tokens/s | e2e p50 ms | e2e p99 ms | router CPU % "
            "| router CPU ms/req | nodes CPU % | client CPU % | errors |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["throughput"]:
        cpu, e = r["cpu_pct"], r["e2e"]
        own = f"{cpu['router']:.0f} | {r['router_cpu_ms_per_req']:.2f}" if r["path"] == "router" else "- | -"
        rows.append(
            f"| {r['path']} | {r['concurrency']} | {r['requests']} | {r['req_s']:,.0f} | {r['tok_s']:,.0f} "
            f"| {e.get('p50_ms', 0):.1f} | {e.get('p99_ms', 0):.1f} | {own} | {cpu['nodes']:.0f} "
            f"| {cpu['client']:.0f} | {r['errors']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.router_overhead", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="20 latency pairs, one 1.5 s throughput level")
    ap.add_argument("--tokens-per-chunk", type=int, default=TOKENS_PER_CHUNK, help="decode tokens per message")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens each request streams")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file")
    args = ap.parse_args(argv)
    report = run(quick=args.quick, tokens_per_chunk=args.tokens_per_chunk, max_tokens=args.max_tokens)
    env = report["env"]
    print(
        f"CPU: {env['cpu']} ({env['cores']} cores), Python {env['python']}, grpcio {env['grpcio']}; "
        f"{report['max_tokens']} tokens per request in chunks of {report['tokens_per_chunk']}, "
        f"{report['prompt_tokens']}-token prompt; load average before/after: "
        f"{env['loadavg_before']} / {env['loadavg_after']}\n"
    )
    print(format_tables(report))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
