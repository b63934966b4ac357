"""`pdserve bench|train`: the load generator and the trainer, with flags generated from their options."""

from __future__ import annotations

import dataclasses
import json
import os

import typer

from loadgen.runner import BenchOptions
from pdserve.errors import fail
from pdserve.flags import with_options
from trainer.options import TrainOptions


@with_options(opts=BenchOptions)
def bench(opts: BenchOptions) -> None:
    """Benchmark an OpenAI-compatible server: streamed requests at swept load, latency/throughput report.

    Workloads (--workload), all generated from --seed: random (default; independent prompts);
    multi-turn (--num-prompts conversations of --turns turns, each turn resending the whole
    history with the server's replies plus a new message, --think-time between turns; the
    conversation is the unit of arrival); shared-prefix (each request starts with one of
    --num-prefixes system prompts of --prefix-len tokens). The last two report TTFT/TPOT per turn
    (or first vs repeated prefix) and the server's cached prompt tokens against the reusable ones:
    a turn's previous prompt plus reply, or a prefix already sent (null when the server does not
    report usage.prompt_tokens_details.cached_tokens).
    """
    import httpx

    from loadgen.runner import run_bench
    from loadgen.sweep import format_summary

    if opts.api_key is None:
        opts = dataclasses.replace(opts, api_key=os.environ.get("OPENAI_API_KEY"))
    try:
        report, files = run_bench(opts, progress=opts.progress)
    except (ValueError, OSError, httpx.HTTPError) as e:
        fail(e)
    typer.echo(format_summary(report))
    for path in files:
        typer.echo(f"wrote {path}")
    if not any(p["metrics"]["completed"] for p in report["points"]):
        fail("no request succeeded", code=1)


@with_options(opts=TrainOptions)
def train(opts: TrainOptions) -> None:
    """Train a target + EAGLE head pair like the built-in one; prints the headline metrics."""
    from trainer.main import PRESETS, run, summary

    if opts.preset is not None and opts.preset not in PRESETS:
        fail(f"--preset must be one of {', '.join(sorted(PRESETS))}, got {opts.preset!r}")
    typer.echo(json.dumps(summary(run(opts)), indent=2))


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
    app.command("train")(train)
