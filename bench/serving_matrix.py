"""Serving comparisons on the built-in pair with `pdserve bench`: colocated vs PD, EAGLE on vs off,
the n-gram plugin on vs off. Each configuration is a real local deployment (router + nodes).

Run: `python -m bench.serving_matrix [--concurrency 1,4] [--num-prompts 16]`; writes
bench/results/serving_matrix.json and prints a markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import write_report
from loadgen.runner import BenchOptions, run_bench
from pdserve.models import BUILTIN_TARGET
from pdserve.up import Deployment, UpConfig

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "serving_matrix"

# name -> (colocated nodes, speculative algorithm); the built-in pair serves them all
CONFIGS: dict[str, tuple[int, str]] = {
    "pd-eagle": (0, "EAGLE"),
    "pd-plain": (0, "NONE"),
    "pd-ngram": (0, "NGRAM"),
    "colocated-eagle": (1, "EAGLE"),
    "colocated-plain": (1, "NONE"),
}


def scrape_accept_len(dep: Deployment) -> float | None:
    """Mean accepted length from the generating node's Prometheus endpoint (decode or colocated)."""
    for child in dep.children:
        port = child.ports.get("metrics")
        if port is None or child.name.startswith("prefill"):
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r"^pdserve_spec_accept_length\{[^}]*\} ([0-9.eE+-]+)$", text, re.M)
        if m:
            return float(m.group(1))
    return None


def run_config(name: str, colocated: int, algo: str, args: argparse.Namespace) -> dict[str, Any]:
    node_args = ("--speculative-algorithm", algo, "--metrics-port", "0", "--device", "cpu")
    dep = Deployment(
        UpConfig(None, port=0, device="cpu", node_args=node_args, colocated=colocated, start_timeout_s=300)
    )
    try:
        url = dep.start(lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True))
        opts = BenchOptions(
            base_url=url,
            tokenizer=BUILTIN_TARGET,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=0.0,
            concurrency=args.concurrency,
            warmup=2,
            out=OUT / name,
            slo=args.slo,
            temperature=0.0,
        )
        report, _ = run_bench(opts, progress=False)
        points = [{"load": pt["load"], "metrics": pt["metrics"]} for pt in report["points"]]
        return {"points": points, "accept_len": scrape_accept_len(dep)}
    finally:
        dep.stop()


def table(results: dict[str, Any]) -> str:
    rows = [
        "| config | concurrency | output tok/s | TPOT p50 ms | TTFT p50 ms | E2E p50 ms | accept len |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, res in results.items():
        for pt in res["points"]:
            m, load = pt["metrics"], pt["load"]
            accept = f"{res['accept_len']:.2f}" if res["accept_len"] else "-"
            rows.append(
                f"| {name} | {load['value']} | {m['output_throughput']:.1f} | "
                f"{m['tpot_ms']['median']:.1f} | {m['ttft_ms']['median']:.1f} | "
                f"{m['e2e_ms']['median']:.1f} | {accept} |"
            )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slo", default="ttft=1s,tpot=50ms")
    ap.add_argument("--only", default=",".join(CONFIGS))
    args = ap.parse_args()
    results = {}
    for name in args.only.split(","):
        colocated, algo = CONFIGS[name]
        results[name] = run_config(name, colocated, algo, args)
        print(f"[{name}] done", file=sys.stderr, flush=True)
    write_report(OUT.parent / "serving_matrix.json", {"args": vars(args), "results": results})
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
