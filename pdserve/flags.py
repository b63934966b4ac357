"""Typer flags generated from the config schemas (common/config.py, common/router_options.py), each
with its PDSERVE_* env var."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from typing import Annotated, Any, Callable, Optional

import typer

from common.config import ENV_PREFIX, SpeculativeOptions
from common.flag_fields import flag_of

# Schemas whose flags carry a prefix (SpeculativeOptions.num_steps <-> --speculative-num-steps).
PREFIXES: dict[type, str] = {SpeculativeOptions: "speculative_"}


def env_name(param: str) -> str:
    """The environment variable of a flag: --max-running -> PDSERVE_MAX_RUNNING."""
    return ENV_PREFIX + param.upper()


def _parameter(f: dataclasses.Field[Any], hint: Any, param: str) -> inspect.Parameter:
    flag = flag_of(f)
    long = "--" + param.replace("_", "-")
    is_bool = hint in (bool, Optional[bool])
    decls = [f"{long}/--no-{long[2:]}" if is_bool and flag.negatable else long, *flag.aliases]
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if typing.get_origin(hint) is list and not required:  # a repeatable flag: none given -> []
        hint, default = Optional[hint], None
    elif required:
        default = inspect.Parameter.empty
    else:
        default = f.default
    # A separator other than whitespace: the command splits the variable itself (`_from_env`).
    envvar = env_name(param) if flag.separator is None else None
    option = typer.Option(*decls, help=flag.help, rich_help_panel=flag.panel, envvar=envvar)
    return inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[hint, option], default=default)


def with_options(**schemas: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a typer command one flag per field of each schema; the command receives the schemas
    built from the flags, as keyword arguments named like `schemas`' keys."""

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        params: list[inspect.Parameter] = []
        plan: list[tuple[str, str, str]] = []  # (argument, field, parameter)
        for arg, cls in schemas.items():
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if "flag" not in f.metadata:  # a setting for scripts, not the command line
                    continue
                param = PREFIXES.get(cls, "") + f.name
                plan.append((arg, f.name, param))
                params.append(_parameter(f, hints[f.name], param))
        params.sort(key=lambda p: p.default is not inspect.Parameter.empty)  # required ones first

        @functools.wraps(fn)
        def command(**kwargs: Any) -> None:
            values: dict[str, dict[str, Any]] = {arg: {} for arg in schemas}
            for arg, name, param in plan:
                value = kwargs[param]
                if value is None and _is_list(schemas[arg], name):
                    value = _from_env(schemas[arg], name, param)
                values[arg][name] = value
            fn(**{arg: cls(**values[arg]) for arg, cls in schemas.items()})

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return command

    return wrap


def _from_env(cls: type, name: str, param: str) -> list[str]:
    """A repeatable flag not given: its variable split on the field's separator (or nothing)."""
    sep = flag_of(next(f for f in dataclasses.fields(cls) if f.name == name)).separator
    raw = os.environ.get(env_name(param), "") if sep is not None else ""
    return [part.strip() for part in raw.split(sep) if part.strip()] if sep is not None else []


def _is_list(cls: type, name: str) -> bool:
    return typing.get_origin(typing.get_type_hints(cls)[name]) is list
