"""`pdserve bench`: the typer command, and `run_bench` that scripts (bench/serving.py) call.

Cheap at import (typer and stdlib only): httpx, rich and matplotlib load when the command runs.
Register it on the main app with `register(app)`; `python -m loadgen.cli` runs it alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

if TYPE_CHECKING:
    from loadgen.metrics import RequestRecord

EXIT_USAGE = 2


@dataclass
class BenchOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: Optional[str] = None
    tokenizer: Optional[Path] = None
    num_prompts: int = 50
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.5
    request_rate: Optional[str] = None
    concurrency: Optional[str] = None
    seed: int = 0
    warmup: int = 0
    slo: Optional[str] = None
    ignore_eos: bool = True
    usage: bool = True
    temperature: float = 0.0
    timeout: float = 300.0
    api_key: Optional[str] = None
    out: Path = Path("bench-results")
    plots: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


def run_bench(opts: BenchOptions, progress: bool = True) -> tuple[dict[str, Any], list[Path]]:
    """Build the prompts, run the sweep, write results.json (+ PNGs); returns (report, files)."""
    import asyncio

    from loadgen.client import EndpointConfig
    from loadgen.dataset import CHARS_PER_TOKEN, random_requests
    from loadgen.metrics import parse_slo
    from loadgen.sweep import SweepConfig, parse_loads, run_sweep, write_report

    if opts.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    loads = parse_loads(opts.request_rate, opts.concurrency)
    endpoint = EndpointConfig(opts.base_url, opts.model or "", opts.endpoint, opts.api_key,
                              opts.ignore_eos, opts.usage, opts.temperature, opts.timeout,
                              extra_body=dict(opts.extra_body))
    tok = _load_tokenizer(opts.tokenizer)
    requests = random_requests(opts.num_prompts, opts.input_len, opts.output_len,
                               range_ratio=opts.range_ratio, seed=opts.seed, tokenizer=tok)
    dataset = {"name": "random (stdlib source)", "num_prompts": opts.num_prompts,
               "input_len": opts.input_len, "output_len": opts.output_len,
               "range_ratio": opts.range_ratio,
               "prompt_cut": f"tokenizer {opts.tokenizer}" if tok else f"~{CHARS_PER_TOKEN} chars/token"}
    cfg = SweepConfig(endpoint, loads, parse_slo(opts.slo), opts.seed, opts.warmup, dataset)
    with _progress(progress) as factory:
        report = asyncio.run(run_sweep(cfg, requests, factory))
    files = [write_report(report, opts.out)]
    if opts.plots:
        from loadgen.plots import write_plots

        files += write_plots(report, opts.out)
    return report, files


def _load_tokenizer(path: Path | None) -> Any:
    if path is None:
        return None
    from common.tokenizer import Tokenizer  # torch-free, as the router uses it

    return Tokenizer.from_dir(path)


class _progress:
    """A rich progress bar on stderr, one bar per load point (or nothing when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                                console=Console(stderr=True))

    def __enter__(self) -> Callable[[str, int], Callable[[RequestRecord], None]] | None:
        if self.bar is None:
            return None
        self.bar.start()
        return self._task

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def _task(self, name: str, total: int) -> Callable[[RequestRecord], None]:
        task = self.bar.add_task(name, total=total, failed=0)
        failed = [0]

        def done(rec: RequestRecord) -> None:
            failed[0] += 0 if rec.ok else 1
            self.bar.update(task, advance=1, failed=failed[0])

        return done


def _fail(message: object, code: int = EXIT_USAGE) -> None:
    typer.echo(f"error: {' '.join(str(message).split()) or type(message).__name__}", err=True)
    raise typer.Exit(code)


Opt = typer.Option


def bench(
    base_url: Annotated[str, Opt(help="Server root, e.g. http://127.0.0.1:8000.")] = "http://127.0.0.1:8000",
    endpoint: Annotated[str, Opt(help="completions (/v1/completions) or chat (/v1/chat/completions).")] = "completions",
    model: Annotated[Optional[str], Opt(help="Model id to send (default: the first of /v1/models).")] = None,
    tokenizer: Annotated[Optional[Path], Opt(help="HF tokenizer directory for exact prompt lengths "
                                             "(default: ~4 characters per token).")] = None,
    num_prompts: Annotated[int, Opt(help="Requests per load point.")] = 50,
    input_len: Annotated[int, Opt(help="Most prompt tokens per request.")] = 256,
    output_len: Annotated[int, Opt(help="Most output tokens per request (max_tokens).")] = 64,
    range_ratio: Annotated[float, Opt(help="Lengths are uniform in [L*(1-r), L]; 0 is exactly L.")] = 0.5,
    request_rate: Annotated[Optional[str], Opt(help="Poisson request rates to sweep, e.g. 1,2,4,inf.")] = None,
    concurrency: Annotated[Optional[str], Opt(help="Fixed concurrencies to sweep, e.g. 1,4,16.")] = None,
    seed: Annotated[int, Opt(help="Seed for lengths, prompts and arrivals.")] = 0,
    warmup: Annotated[int, Opt(help="Uncounted requests sent before the sweep.")] = 0,
    slo: Annotated[Optional[str], Opt(help="Goodput SLO, e.g. ttft=500ms,tpot=50ms (also itl, e2e).")] = None,
    ignore_eos: Annotated[bool, Opt(help="Send ignore_eos so outputs are as long as asked "
                                    "(--no-ignore-eos for servers that refuse it).")] = True,
    usage: Annotated[bool, Opt(help="Ask for stream usage (include_usage) to count tokens; "
                               "--no-usage counts one token per chunk.")] = True,
    temperature: Annotated[float, Opt(help="Sampling temperature.")] = 0.0,
    timeout: Annotated[float, Opt(help="Seconds one request may take in all.")] = 300.0,
    api_key: Annotated[Optional[str], Opt(help="Bearer token (default: $OPENAI_API_KEY).")] = None,
    out: Annotated[Path, Opt(help="Folder for results.json, latency.png, throughput.png.")] = Path("bench-results"),
    plots: Annotated[bool, Opt(help="Write the PNG plots.")] = True,
    progress: Annotated[bool, Opt(help="Show a progress bar on stderr.")] = True,
) -> None:
    """Benchmark an OpenAI-compatible server: streamed requests at swept load, latency/throughput report."""
    import httpx

    from loadgen.sweep import format_summary

    opts = BenchOptions(base_url, endpoint, model, tokenizer, num_prompts, input_len, output_len,
                        range_ratio, request_rate, concurrency, seed, warmup, slo, ignore_eos, usage,
                        temperature, timeout, api_key or os.environ.get("OPENAI_API_KEY"), out, plots)
    try:
        report, files = run_bench(opts, progress=progress)
    except (ValueError, OSError, httpx.HTTPError) as e:
        _fail(e)
    typer.echo(format_summary(report))
    for path in files:
        typer.echo(f"wrote {path}")
    if not any(p["metrics"]["completed"] for p in report["points"]):
        _fail("no request succeeded", code=1)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)


def main() -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(bench)
    app()


if __name__ == "__main__":
    main()
