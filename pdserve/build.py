"""Turning the CLI's config schemas into an engine: model defaults, speculative binding, device checks.

Imported only inside commands (it reaches torch through the engine).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import EngineOptions, SpeculativeOptions

if TYPE_CHECKING:
    from engine.core import SamplingParams
    from engine.engine import Engine, EngineConfig
    from spec.config import SpecConfig
    from spec.registry import AlgorithmBinding


def engine_config(model: Path, *, dtype: str | None, device: str, page_size: int, seed: int | None) -> EngineConfig:
    """The EngineConfig for `generate` (the model already resolved by pdserve.models.resolve)."""
    from engine.engine import EngineConfig

    _check_device(device)
    # The engine seeds per-request seeds from this, so a batch is reproducible yet every
    # prompt samples differently (a shared SamplingParams.seed would make them identical).
    return EngineConfig(model=str(model), dtype=dtype, device=device, page_size=page_size, seed=seed)


def _check_device(device: str) -> None:
    """Refuse a malformed or absent device up front; torch would fail deep in model loading
    with a RuntimeError or AssertionError that names neither the option nor the device."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    # The engine has CPU and CUDA paths only (DESIGN.md §3); other torch backends fail deep inside.
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available in this torch build or machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")


def sampling_params(
    *, max_new_tokens: int, temperature: float, top_p: float, top_k: int, min_p: float, stop: list[str] | None
) -> SamplingParams:
    """SamplingParams validates every field and raises InvalidRequest naming the bad one."""
    from engine.core import SamplingParams

    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=tuple(stop or ()),
    )


def spec_config(algorithm: str | None, **options: object) -> SpecConfig:
    """The SpecConfig for the speculative flags (the registry's default algorithm when None).

    `options` are SpecConfig fields named like their flags (num_steps <-> --speculative-num-steps).
    Unset (None) ones are left out so that SpecConfig's defaults live in one place. Raises
    SpecRegistryError (a ValueError) listing the known algorithms for an unknown name.
    """
    from spec.config import SpecConfig
    from spec.registry import SpeculativeAlgorithm

    given = {name: value for name, value in options.items() if value is not None}
    algo = SpeculativeAlgorithm.from_name(algorithm.upper() if algorithm else None)
    if algo.is_none():
        if given:  # silently ignoring them would let a user believe speculation ran
            flags = ", ".join(_spec_flag(name) for name in given)
            raise ValueError(f"{flags} need --speculative-algorithm (it is {algo.name})")
        return SpecConfig(algorithm=algo.name)
    for path_option in ("draft_model_path", "adaptive_config"):
        if path_option in given:
            given[path_option] = str(given[path_option])
    return SpecConfig(algorithm=algo.name, **given)  # type: ignore[arg-type]


def _spec_flag(field: str) -> str:
    return "--speculative-" + field.replace("_", "-")


def bind_algorithm(cfg: SpecConfig) -> AlgorithmBinding:
    """Resolve and check the speculative settings before the (slow) target load.

    Raises SpecConfigError / SpecRegistryError (both ValueErrors) naming the flag or listing
    the known algorithms; a bad draft directory surfaces later, as ModelLoadError, from Engine.
    """
    from spec.registry import bind

    return bind(cfg)


def build_engine(config: EngineConfig, binding: AlgorithmBinding) -> Engine:
    """Load the model behind a spinner on stderr, so stdout carries only generated text."""
    from rich.console import Console

    from engine.engine import Engine

    with Console(stderr=True).status(f"loading model {config.model} ...", spinner="dots"):
        return Engine(config, algorithm=binding)


def resolve_device(device: str) -> str:
    """`auto`: the first GPU when torch sees one, else the CPU (what `pdserve up` picks per node);
    any other name is kept as given (check_device judges it)."""
    if device != "auto":
        return device
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def limit_cpu_threads(device: str) -> None:
    """A GPU node's CPU tensors are a few small rows: one intra-op thread, unless OMP_NUM_THREADS
    says otherwise. Torch's default (a thread per core, spinning after each op) lets the nodes of
    one host steal each other's cores and makes their host-bound launch paths jittery."""
    if device.startswith("cuda") and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def build_node(engine: EngineOptions, spec: SpeculativeOptions) -> tuple["Engine", Any]:
    """Load the engine for a node (threaded scheduler IO); returns (engine, algorithm binding)."""
    from engine.engine import Engine, EngineConfig, check_device
    from engine.loop import ThreadedIO
    from pdserve.models import resolve

    # Once, here: the model defaults, the fast path and the engine all read the resolved name.
    engine = dataclasses.replace(engine, device=resolve_device(engine.device))
    check_device(engine.device)
    limit_cpu_threads(engine.device)
    choice = resolve(
        engine.model,
        algorithm=spec.algorithm,
        draft_model_path=spec.draft_model_path,
        num_steps=spec.num_steps,
        dtype=engine.dtype,
        device=engine.device,
        adaptive=spec.adaptive,
    )
    binding = bind_algorithm(
        spec_config(
            choice.algorithm,
            **{**spec.given(), "draft_model_path": choice.draft_model_path, "num_steps": choice.num_steps},
        )
    )
    cfg = EngineConfig(
        model=str(choice.model),
        dtype=choice.dtype,
        device=engine.device,
        page_size=engine.page_size,
        max_total_tokens=engine.max_total_tokens,
        mem_fraction_static=engine.mem_fraction_static,
        max_running=engine.max_running,
        chunked_prefill_size=engine.chunked_prefill_size,
        **engine.fast_path(),
    )
    return Engine(cfg, algorithm=binding, io=ThreadedIO()), binding
