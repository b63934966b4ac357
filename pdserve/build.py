"""Turning the CLI's config schemas into an engine: model defaults, speculative binding, device checks.

Each schema becomes the engine's EngineConfig in one function here (`engine_config` for a node's
EngineOptions, `generate_config` for `pdserve generate`). Imported only inside commands (it reaches
torch through the engine).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import EngineOptions, GenerateOptions, SpeculativeOptions
from common.defaults import DEFAULT_MAX_RUNNING

if TYPE_CHECKING:
    from engine.core import SamplingParams
    from engine.config import EngineConfig
    from engine.engine import Engine
    from pdserve.models import ModelChoice
    from spec.config import SpecConfig
    from spec.registry import AlgorithmBinding


def engine_config(options: EngineOptions, choice: ModelChoice) -> EngineConfig:
    """A node's EngineConfig: its flags, the model `choice` (pdserve.models.resolve) and the fast
    path; `options.device` already resolved from auto."""
    from engine.config import EngineConfig

    return EngineConfig(
        model=str(choice.model),
        dtype=choice.dtype,
        device=options.device,
        page_size=options.page_size,
        max_total_tokens=options.max_total_tokens,
        mem_fraction_static=options.mem_fraction_static,
        max_running=options.max_running or DEFAULT_MAX_RUNNING,
        chunked_prefill_size=options.chunked_prefill_size,
        radix_cache=not options.disable_radix_cache,
        mixed_chunk=not options.disable_mixed_chunk,
        grammar_backend=options.grammar_backend,
        tp_size=options.tp_size,
        tp_timeout_s=options.tp_timeout_s,
        **options.fast_path(),
    )


def generate_config(options: GenerateOptions, choice: ModelChoice) -> EngineConfig:
    """The EngineConfig of `pdserve generate` (the model already resolved into `choice`)."""
    from engine.config import EngineConfig

    check_device(options.device)
    # The engine seeds per-request seeds from this, so a batch is reproducible yet every
    # prompt samples differently (a shared SamplingParams.seed would make them identical).
    return EngineConfig(
        model=str(choice.model),
        dtype=choice.dtype,
        device=options.device,
        page_size=options.page_size,
        seed=options.seed,
    )


def check_device(device: str) -> None:
    """engine.config.check_device (cpu or an existing cuda device), its error naming the flag."""
    from engine.config import check_device as engine_check_device

    try:
        engine_check_device(device)
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None


def check_tp(options: EngineOptions, model_dir: Path) -> None:
    """--tp-size before the (slow) load: a size of at least 1, its GPUs present from --device on,
    and a model whose heads and MLP split over it (pdserve/tp.py)."""
    from pdserve.tp import check_gpus, check_model_split, check_tp_flags

    check_tp_flags(options.tp_size, options.tp_timeout_s)
    if options.device.startswith("cuda"):
        import torch

        check_gpus(options.device, options.tp_size, torch.cuda.device_count())
    check_model_split(model_dir, options.tp_size)


def sampling_params(options: GenerateOptions) -> SamplingParams:
    """`pdserve generate`'s sampling flags; SamplingParams raises InvalidRequest naming a bad one."""
    from engine.core import SamplingParams

    return SamplingParams(
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        stop=tuple(options.stop),
    )


def choose_model(
    model: Path | None, dtype: str | None, device: str, spec: SpeculativeOptions
) -> tuple[ModelChoice, AlgorithmBinding]:
    """What to load (the built-in pair's defaults applied) and its speculative binding, checked
    before the (slow) model load."""
    from pdserve.models import resolve

    choice = resolve(
        model,
        algorithm=spec.algorithm,
        draft_model_path=spec.draft_model_path,
        num_steps=spec.num_steps,
        dtype=dtype,
        device=device,
        adaptive=spec.adaptive,
    )
    binding = bind_algorithm(
        spec_config(
            choice.algorithm,
            **{**spec.given(), "draft_model_path": choice.draft_model_path, "num_steps": choice.num_steps},
        )
    )
    return choice, binding


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


def build_node(
    engine: EngineOptions, spec: SpeculativeOptions, tpot_guard_ms: float | None = None
) -> tuple[Engine, AlgorithmBinding]:
    """Load the engine for a node (threaded scheduler IO; `tpot_guard_ms`: a decode node's guard
    for the prompts it runs itself); returns (engine, algorithm binding)."""
    from engine.engine import Engine
    from engine.loop import ThreadedIO

    # Once, here: the model defaults, the fast path and the engine all read the resolved name.
    engine = dataclasses.replace(engine, device=resolve_device(engine.device))
    check_device(engine.device)
    limit_cpu_threads(engine.device)
    choice, binding = choose_model(engine.model, engine.dtype, engine.device, spec)
    check_tp(engine, choice.model)
    config = dataclasses.replace(engine_config(engine, choice), tpot_guard_ms=tpot_guard_ms)
    return Engine(config, algorithm=binding, io=ThreadedIO()), binding
