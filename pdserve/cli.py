"""The `pdserve` command line: one typer app, one subcommand per role (today: `generate`).

Importing this module must stay cheap and torch-free (the router and `--help` use it), so every
subcommand imports the engine inside its function body.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer

if TYPE_CHECKING:  # only for annotations; importing these at run time would pull in torch
    from engine.core import SamplingParams
    from engine.engine import Engine, EngineConfig
    from spec.config import SpecConfig
    from spec.registry import AlgorithmBinding

app = typer.Typer(
    name="pdserve",
    help="Prefill/decode disaggregated LLM serving with speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    # Errors we expect are reported as one line by `_fail`; anything else is a bug and keeps
    # the plain traceback (rich's boxed traceback hides the frames a bug report needs).
    pretty_exceptions_enable=False,
)

EXIT_USAGE = 2  # same code click uses for bad options, so scripts see one "you asked wrong" code


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    """pdserve: serve, benchmark and try out models (roles load lazily)."""
    # A callback keeps `generate` a named subcommand even while it is the only one.
    if version:
        from pdserve import __version__

        typer.echo(__version__)
        raise typer.Exit()
    if ctx.invoked_subcommand is None:  # e.g. `pdserve --some-root-flag` without a command
        typer.echo(ctx.get_help())
        raise typer.Exit(EXIT_USAGE)


def _fail(message: object, code: int = EXIT_USAGE) -> NoReturn:
    """Print `error: ...` on one line to stderr and exit without a traceback."""
    text = " ".join(str(message).split()) or type(message).__name__
    typer.echo(f"error: {text}", err=True)
    raise typer.Exit(code)


# ---- generate: builders kept small so new options (e.g. speculative ones) slot in easily ----

def engine_config(model: Path, *, dtype: str | None, device: str, page_size: int,
                  seed: int | None) -> EngineConfig:
    """The EngineConfig for `generate` (the model already resolved by pdserve.models.resolve)."""
    from engine.engine import EngineConfig

    _check_device(device)
    # The engine seeds per-request seeds from this, so a batch is reproducible yet every
    # prompt samples differently (a shared SamplingParams.seed would make them identical).
    return EngineConfig(model=str(model), dtype=dtype, device=device, page_size=page_size,
                        seed=seed)


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


def sampling_params(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                    min_p: float, stop: list[str] | None) -> SamplingParams:
    """SamplingParams validates every field and raises InvalidRequest naming the bad one."""
    from engine.core import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k, min_p=min_p, stop=tuple(stop or ()))


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


def spec_summary(engine: Engine, algorithm: str) -> str | None:
    """One stderr line on how well speculation did, or None if the worker keeps no SpecStats."""
    stats = engine.executor.spec_stats()
    if stats is None:  # plain decoding
        return None
    return (f"speculative {algorithm.upper()}: {stats.mean_accept_len:.2f} tokens per target "
            f"forward (mean accepted length), acceptance rate {100 * stats.acceptance_rate:.1f}%, "
            f"{stats.verifies} verifies")


def prompt_inputs(engine: Engine, prompts: list[str], chat: bool) -> list[str | list[int]]:
    """Plain prompts go in as text; chat prompts are rendered and tokenized here."""
    if not chat:
        return list(prompts)
    if engine.tokenizer is None:
        from engine.core import InvalidRequest

        raise InvalidRequest("--chat needs a tokenizer; this model directory has none")
    tok = engine.tokenizer
    # The template renders its own BOS; passing the rendered text to the engine would encode
    # it with special tokens and add a second BOS, so hand over ids encoded without them.
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                               add_generation_prompt=True),
                       add_special_tokens=False)
            for p in prompts]


def _stream_one(engine: Engine, prompt: str | list[int], params: SamplingParams) -> tuple[int, str]:
    """Write text to stdout as it arrives; returns (tokens, finish reason)."""
    n_tokens, reason = 0, "unknown"
    for delta in engine.stream(prompt, params):
        n_tokens += len(delta.token_ids)
        piece = delta.text if delta.text is not None else _ids_text(delta.token_ids)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()  # token by token, even when stdout is a pipe
        if delta.finished:
            reason = _reason(delta.finish_reason)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return n_tokens, reason


def _generate_batch(engine: Engine, prompts: list[str], inputs: list[str | list[int]],
                    params: SamplingParams) -> tuple[int, str]:
    """Run all prompts as one batch, print each result; returns (tokens, finish reasons)."""
    outputs = engine.generate(inputs, params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        text = out.text if out.text is not None else _ids_text(out.output_ids)
        typer.echo(f"--- [{i}] {prompt!r} ({len(out.output_ids)} tokens, "
                   f"{_reason(out.finish_reason)})")
        typer.echo(text)
    reasons = sorted({_reason(o.finish_reason) for o in outputs})
    return sum(len(o.output_ids) for o in outputs), ",".join(reasons)


def _ids_text(ids: list[int]) -> str:
    # Models without a tokenizer stream raw ids; a trailing space keeps them apart.
    return "".join(f"{t} " for t in ids)


def _reason(reason: object) -> str:
    return str(getattr(reason, "value", reason)) if reason is not None else "unknown"


@app.command()
def generate(
    prompt: Annotated[list[str], typer.Option(
        "--prompt", "-p", help="Prompt text; repeat for a batch (one prompt streams).")],
    model: Annotated[Optional[Path], typer.Option(
        help="HF-format model directory (default: the built-in Python-code pair, EAGLE on).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; -1 is off.")] = -1,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p * max prob.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(
        help="Stop string (repeatable); the output ends before it.")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        help="float32, bfloat16 or float16 (default: the checkpoint's).")] = None,
    device: Annotated[str, typer.Option(help="torch device, e.g. cpu or cuda.")] = "cpu",
    page_size: Annotated[int, typer.Option(help="Tokens per KV cache page.")] = 16,
    chat: Annotated[bool, typer.Option(
        "--chat", help="Wrap each prompt as a user message with the chat template.")] = False,
    speculative_algorithm: Annotated[Optional[str], typer.Option(
        help="NONE, EAGLE, EAGLE3 or a registered plugin such as NGRAM (case-insensitive; default: "
             "EAGLE with the built-in pair, else NONE).",
        rich_help_panel="Speculative decoding")] = None,
    speculative_draft_model_path: Annotated[Optional[Path], typer.Option(
        help="Draft head directory (HF format), needed by EAGLE and EAGLE3.",
        rich_help_panel="Speculative decoding")] = None,
    speculative_num_steps: Annotated[Optional[int], typer.Option(
        help="Draft steps per verify (default 3).", rich_help_panel="Speculative decoding")] = None,
    speculative_eagle_topk: Annotated[Optional[int], typer.Option(
        help="Branches per draft step; 1 is a chain, more is a tree (default 1).",
        rich_help_panel="Speculative decoding")] = None,
    speculative_num_draft_tokens: Annotated[Optional[int], typer.Option(
        help="Tokens per verify, root included (default: num_steps + 1 for a chain, more for a tree).",
        rich_help_panel="Speculative decoding")] = None,
    speculative_ngram_min: Annotated[Optional[int], typer.Option(
        help="NGRAM: shortest suffix to look up (default 1).",
        rich_help_panel="Speculative decoding")] = None,
    speculative_ngram_max: Annotated[Optional[int], typer.Option(
        help="NGRAM: longest suffix to look up (default 4).",
        rich_help_panel="Speculative decoding")] = None,
) -> None:
    """Generate text for one prompt (streamed) or several (batched) with the in-process engine."""
    from engine.config import ModelLoadError
    from common.tokenizer import TokenizerFileNotFoundError

    try:
        # Validate sampling and speculative options before the (slow) model load, so typos
        # fail fast; only a bad draft head directory is found during the load.
        params = sampling_params(max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, min_p=min_p, stop=stop)
        from pdserve.models import resolve

        choice = resolve(model, algorithm=speculative_algorithm,
                         draft_model_path=speculative_draft_model_path,
                         num_steps=speculative_num_steps, dtype=dtype, device=device)
        spec = spec_config(choice.algorithm, draft_model_path=choice.draft_model_path,
                           num_steps=choice.num_steps, eagle_topk=speculative_eagle_topk,
                           num_draft_tokens=speculative_num_draft_tokens,
                           ngram_min=speculative_ngram_min, ngram_max=speculative_ngram_max)
        binding = bind_algorithm(spec)
        engine = build_engine(engine_config(choice.model, dtype=choice.dtype, device=device,
                                            page_size=page_size, seed=seed), binding)
        inputs = prompt_inputs(engine, prompt, chat)
        start = time.perf_counter()
        if len(inputs) == 1:
            n_tokens, reason = _stream_one(engine, inputs[0], params)
        else:
            n_tokens, reason = _generate_batch(engine, prompt, inputs, params)
        elapsed = time.perf_counter() - start
    # InvalidRequest, ChatTemplateError, bad dtypes, SpecConfigError and SpecRegistryError are
    # all ValueErrors; a bad draft head directory raises ModelLoadError.
    except (ModelLoadError, TokenizerFileNotFoundError, ValueError) as e:
        _fail(e)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        _fail("interrupted", code=130)
    rate = n_tokens / elapsed if elapsed > 0 else 0.0
    typer.echo(f"{n_tokens} tokens in {elapsed:.2f} s ({rate:.1f} tok/s), finish: {reason}",
               err=True)
    summary = spec_summary(engine, binding.name)
    if summary:
        typer.echo(summary, err=True)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def train(ctx: typer.Context) -> None:
    """Train a target + EAGLE head pair like the built-in one (`pdserve train --help` for options)."""
    from trainer.main import main

    main(list(ctx.args))


def _register_node_commands() -> None:
    from pdserve import node_cli
    from loadgen.cli import register as register_bench

    node_cli.register(app)
    register_bench(app)


_register_node_commands()

if __name__ == "__main__":
    app()
