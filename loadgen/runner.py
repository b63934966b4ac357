"""`pdserve bench`'s settings (BenchOptions) and `run_bench`, which the command and scripts call.

Workloads (`--workload`): random (the default: independent prompts from random corpus offsets),
multi-turn and shared-prefix (prefix-reuse workloads, loadgen/workloads.py; their flags are
refused with the other workloads). Cheap at import (stdlib only): httpx, rich and matplotlib
load when a run starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from common.flag_fields import opt

if TYPE_CHECKING:
    from loadgen.metrics import RequestRecord
    from loadgen.sweep import Workload

WORKLOADS = ("random", "multi-turn", "shared-prefix")
PANEL_REUSE = "Prefix-reuse workloads"
# Defaults of the workload flags, applied only for their workload (None: not given, so a flag
# given to the wrong workload is an error instead of being silently ignored).
MULTI_TURN_DEFAULTS = {"turns": 10, "turn_input_len": 200, "think_time": 0.0}
SHARED_PREFIX_DEFAULTS = {"num_prefixes": 4, "prefix_len": 512}


@dataclass
class BenchOptions:
    """One `pdserve bench` run: the server, the requests, the load points and the outputs."""

    base_url: str = opt("http://127.0.0.1:8000", "Server root, e.g. http://127.0.0.1:8000.")
    endpoint: str = opt("completions", "completions (/v1/completions) or chat (/v1/chat/completions).")
    model: Optional[str] = opt(None, "Model id to send (default: the first of /v1/models).")
    tokenizer: Optional[Path] = opt(
        None, "HF tokenizer directory for exact prompt lengths (default: ~4 characters per token)."
    )
    workload: str = opt(
        "random",
        "random (independent prompts), multi-turn (conversations whose turns resend the whole history) "
        "or shared-prefix (requests behind a few shared system prompts); the last two report the "
        "server's cached prompt tokens against the reusable ones.",
    )
    num_prompts: int = opt(50, "Requests per load point (multi-turn: conversations, of --turns requests each).")
    input_len: int = opt(
        256, "Most prompt tokens per request (multi-turn: turn 1's message; shared-prefix: the part after the prefix)."
    )
    output_len: int = opt(64, "Most output tokens per request (max_tokens).")
    range_ratio: float = opt(0.5, "Lengths are uniform in [L*(1-r), L]; 0 is exactly L.")
    request_rate: Optional[str] = opt(None, "Poisson request rates to sweep, e.g. 1,2,4,inf.")
    concurrency: Optional[str] = opt(None, "Fixed concurrencies to sweep, e.g. 1,4,16.")
    seed: int = opt(0, "Seed for lengths, prompts and arrivals.")
    warmup: int = opt(0, "Uncounted requests sent before the sweep.")
    slo: Optional[str] = opt(
        None,
        "SLO, e.g. ttft=500ms,tpot=50ms (also itl, e2e): each point's attainment, and the goodput "
        "(the highest swept rate with >= 90% of requests within it).",
    )
    ignore_eos: bool = opt(
        True, "Send ignore_eos so outputs are as long as asked (--no-ignore-eos for servers that refuse it)."
    )
    usage: bool = opt(
        True, "Ask for stream usage (include_usage) to count tokens; --no-usage counts one token per chunk."
    )
    temperature: float = opt(0.0, "Sampling temperature.")
    timeout: float = opt(300.0, "Seconds one request may take in all.")
    api_key: Optional[str] = opt(None, "Bearer token (default: $OPENAI_API_KEY).")
    out: Path = opt(Path("bench-results"), "Folder for results.json, latency.png, throughput.png.")
    plots: bool = opt(True, "Write the PNG plots.")
    extra_body: dict[str, Any] = field(default_factory=dict)  # scripts only: merged into each request
    progress: bool = opt(True, "Show a progress bar on stderr.")
    turns: Optional[int] = opt(None, "multi-turn: turns per conversation (default 10).", panel=PANEL_REUSE)
    turn_input_len: Optional[int] = opt(
        None, "multi-turn: most tokens of each later turn's new user message (default 200).", panel=PANEL_REUSE
    )
    think_time: Optional[float] = opt(
        None,
        "multi-turn: mean seconds between a reply and the conversation's next turn (exponential, seeded; default 0).",
        panel=PANEL_REUSE,
    )
    num_prefixes: Optional[int] = opt(None, "shared-prefix: distinct system prompts (default 4).", panel=PANEL_REUSE)
    prefix_len: Optional[int] = opt(
        None, "shared-prefix: tokens of each system prompt (default 512).", panel=PANEL_REUSE
    )


def run_bench(opts: BenchOptions, progress: bool = True) -> tuple[dict[str, Any], list[Path]]:
    """Build the prompts, run the sweep, write results.json (+ PNGs); returns (report, files)."""
    import asyncio

    from loadgen.client import EndpointConfig
    from loadgen.dataset import CHARS_PER_TOKEN, random_requests
    from loadgen.metrics import parse_slo
    from loadgen.sweep import SweepConfig, parse_loads, run_sweep, write_report

    if opts.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    check_workload_flags(opts)
    loads = parse_loads(opts.request_rate, opts.concurrency)
    endpoint = EndpointConfig(
        opts.base_url,
        opts.model or "",
        opts.endpoint,
        opts.api_key,
        opts.ignore_eos,
        opts.usage,
        opts.temperature,
        opts.timeout,
        extra_body=dict(opts.extra_body),
    )
    tok = _load_tokenizer(opts.tokenizer)
    dataset: dict[str, Any] = {
        "name": "random (stdlib source)",
        "num_prompts": opts.num_prompts,
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "range_ratio": opts.range_ratio,
        "prompt_cut": f"tokenizer {opts.tokenizer}" if tok else f"~{CHARS_PER_TOKEN} chars/token",
    }
    work: list[Any] | Workload
    if opts.workload == "random":
        work = random_requests(
            opts.num_prompts,
            opts.input_len,
            opts.output_len,
            range_ratio=opts.range_ratio,
            seed=opts.seed,
            tokenizer=tok,
        )
    else:
        work, extra = _reuse_workload(opts, tok)
        dataset.update(extra)
    cfg = SweepConfig(endpoint, loads, parse_slo(opts.slo), opts.seed, opts.warmup, dataset)
    with _progress(progress) as factory:
        report = asyncio.run(run_sweep(cfg, work, factory))
    files = [write_report(report, opts.out)]
    if opts.plots:
        from loadgen.plots import write_plots

        files += write_plots(report, opts.out)
    return report, files


def check_workload_flags(opts: BenchOptions) -> None:
    """Refuse an unknown workload, another workload's flags, and values out of range."""
    if opts.workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, not {opts.workload!r}")
    own = {"multi-turn": MULTI_TURN_DEFAULTS, "shared-prefix": SHARED_PREFIX_DEFAULTS}.get(opts.workload, {})
    for name in (*MULTI_TURN_DEFAULTS, *SHARED_PREFIX_DEFAULTS):
        if getattr(opts, name) is not None and name not in own:
            flag = "--" + name.replace("_", "-")
            whose = "multi-turn" if name in MULTI_TURN_DEFAULTS else "shared-prefix"
            raise ValueError(f"{flag} applies to --workload {whose} only (this run is --workload {opts.workload})")
    for name in ("turns", "turn_input_len", "num_prefixes", "prefix_len"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    if opts.think_time is not None and not opts.think_time >= 0:  # `not >=` also refuses NaN
        raise ValueError(f"--think-time must be >= 0 seconds, not {opts.think_time}")


def _reuse_workload(opts: BenchOptions, tok: Any) -> tuple[Workload, dict[str, Any]]:
    """The multi-turn or shared-prefix workload, with their flags' defaults filled in."""
    from loadgen.reuse_points import MultiTurnWorkload, SharedPrefixWorkload

    def value(name: str, defaults: dict[str, Any]) -> Any:
        given = getattr(opts, name)
        return defaults[name] if given is None else given

    if opts.workload == "multi-turn":
        turns, turn_len, think = (value(n, MULTI_TURN_DEFAULTS) for n in MULTI_TURN_DEFAULTS)
        extra = {"name": "multi-turn (stdlib source)", "conversations": opts.num_prompts, "turns": turns}
        extra |= {"turn_input_len": turn_len, "think_time_s": think}
        work: Workload = MultiTurnWorkload(
            opts.num_prompts,
            turns,
            opts.input_len,
            turn_len,
            opts.output_len,
            opts.range_ratio,
            think,
            opts.seed,
            opts.endpoint,
            tok,
        )
        return work, extra
    num_prefixes, prefix_len = (value(n, SHARED_PREFIX_DEFAULTS) for n in SHARED_PREFIX_DEFAULTS)
    extra = {"name": "shared-prefix (stdlib source)", "num_prefixes": num_prefixes, "prefix_len": prefix_len}
    work = SharedPrefixWorkload(
        opts.num_prompts,
        num_prefixes,
        prefix_len,
        opts.input_len,
        opts.output_len,
        opts.range_ratio,
        opts.seed,
        opts.endpoint,
        tok,
    )
    return work, extra


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

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed {task.fields[failed]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )

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
