"""Serving benchmark: `pdserve bench` with its results under bench/results/serving/.

Run: `python -m bench.serving [--up [--up-model DIR]] [pdserve bench options...]`.
Every option of `pdserve bench` passes through (see `python -m bench.serving --help`);
`--out` defaults to bench/results/serving. `--up` first starts a local deployment (router +
prefill + decode on 127.0.0.1, as `pdserve up`; the demo model unless `--up-model`), benchmarks
it and stops it; without `--up` point `--base-url` at any running OpenAI-compatible server.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from pdserve.tools_cli import bench

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "serving"
UP_TIMEOUT_S = 300.0


def _pop_flag(argv: list[str], flag: str, takes_value: bool) -> tuple[str | bool | None, list[str]]:
    """Remove `flag` (and its value) from argv; returns (value or True, the rest)."""
    rest, found, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag:
            found = argv[i + 1] if takes_value and i + 1 < len(argv) else True
            i += 2 if takes_value else 1
            continue
        if takes_value and arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return found, rest


def _run_bench(argv: list[str]) -> int:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(bench)
    code = app(args=argv, prog_name="python -m bench.serving", standalone_mode=False)
    return int(code or 0)


def main(argv: list[str] | None = None, up_timeout_s: float = UP_TIMEOUT_S) -> int:
    """Returns the exit code (0: the run finished and wrote its results)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    up, argv = _pop_flag(argv, "--up", takes_value=False)
    up_model, argv = _pop_flag(argv, "--up-model", takes_value=True)
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", str(DEFAULT_OUT)]
    if not up:
        return _run_bench(argv)
    from pdserve.up import Deployment, UpConfig

    dep = Deployment(
        UpConfig(str(up_model) if isinstance(up_model, str) else None, port=0, start_timeout_s=up_timeout_s)
    )
    try:
        url = dep.start(lambda msg: print(f"pdserve up: {msg}", file=sys.stderr, flush=True))
        return _run_bench([*argv, "--base-url", url])
    finally:
        dep.stop()


if __name__ == "__main__":
    sys.exit(main())
