"""How every pdserve command reports an expected failure: one `error: ...` line and an exit code."""

from __future__ import annotations

from typing import NoReturn

import typer

EXIT_USAGE = 2  # same code click uses for bad options, so scripts see one "you asked wrong" code


def fail(message: object, code: int = EXIT_USAGE) -> NoReturn:
    """Print `error: ...` on one line to stderr and exit without a traceback."""
    text = " ".join(str(message).split()) or type(message).__name__
    typer.echo(f"error: {text}", err=True)
    raise typer.Exit(code)
