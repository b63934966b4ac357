"""A config field that is also a command-line flag: its help, SGLang aliases and --help panel."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line."""

    help: str
    aliases: tuple[str, ...] = ()  # extra long names (SGLang's) or a short one ("-p")
    panel: str | None = None  # the --help section
    negatable: bool = True  # booleans: --x/--no-x (False: --x only)
    separator: str | None = None  # repeatable flags: what splits the env var's values (None: whitespace)


def opt(
    default: Any,
    help: str,
    *,
    aliases: tuple[str, ...] = (),
    panel: str | None = None,
    negatable: bool = True,
    separator: str | None = None,
) -> Any:
    """A config field that is also a flag; `default=...` makes the flag required."""
    meta = {"flag": Flag(help, aliases, panel, negatable, separator)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta) if default is not ... else field(metadata=meta)


def flag_of(f: dataclasses.Field[Any]) -> Flag:
    return f.metadata.get("flag") or Flag(help="")
