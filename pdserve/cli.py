"""The `pdserve` command line: one typer app, one subcommand per role (generate, serve, prefill,
decode, router, up, bench, train).

Importing this module must stay cheap and torch-free (the router and `--help` use it), so every
subcommand imports the engine inside its function body.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

from common.config import GenerateOptions, SpeculativeOptions
from pdserve.errors import EXIT_USAGE, fail
from pdserve.flags import with_options

if TYPE_CHECKING:  # only for annotations; importing these at run time would pull in torch
    from engine.core import SamplingParams
    from engine.engine import Engine

app = typer.Typer(
    name="pdserve",
    help="Prefill/decode disaggregated LLM serving with speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    # Errors we expect are reported as one line by `pdserve.errors.fail`; anything else is a bug
    # and keeps the plain traceback (rich's boxed traceback hides the frames a bug report needs).
    pretty_exceptions_enable=False,
)


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


# ---- generate ----


def spec_summary(engine: Engine, algorithm: str) -> str | None:
    """One stderr line on how well speculation did, or None if the worker keeps no SpecStats."""
    stats = engine.executor.spec_stats()
    if stats is None:  # plain decoding
        return None
    return (
        f"speculative {algorithm.upper()}: {stats.mean_accept_len:.2f} tokens per target "
        f"forward (mean accepted length), acceptance rate {100 * stats.acceptance_rate:.1f}%, "
        f"{stats.verifies} verifies"
    )


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
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for p in prompts
    ]


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


def _generate_batch(
    engine: Engine, prompts: list[str], inputs: list[str | list[int]], params: SamplingParams
) -> tuple[int, str]:
    """Run all prompts as one batch, print each result; returns (tokens, finish reasons)."""
    outputs = engine.generate(inputs, params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        text = out.text if out.text is not None else _ids_text(out.output_ids)
        typer.echo(f"--- [{i}] {prompt!r} ({len(out.output_ids)} tokens, {_reason(out.finish_reason)})")
        typer.echo(text)
    reasons = sorted({_reason(o.finish_reason) for o in outputs})
    return sum(len(o.output_ids) for o in outputs), ",".join(reasons)


def _ids_text(ids: list[int]) -> str:
    # Models without a tokenizer stream raw ids; a trailing space keeps them apart.
    return "".join(f"{t} " for t in ids)


def _reason(reason: object) -> str:
    return str(getattr(reason, "value", reason)) if reason is not None else "unknown"


@app.command()
@with_options(opts=GenerateOptions, spec=SpeculativeOptions)
def generate(opts: GenerateOptions, spec: SpeculativeOptions) -> None:
    """Generate text for one prompt (streamed) or several (batched) with the in-process engine."""
    from common.tokenizer import TokenizerFileNotFoundError
    from engine.config import ModelLoadError
    from pdserve.build import build_engine, choose_model, generate_config, sampling_params

    prompt = opts.prompt
    try:
        # Validate sampling and speculative options before the (slow) model load, so typos
        # fail fast; only a bad draft head directory is found during the load.
        params = sampling_params(opts)
        choice, binding = choose_model(opts.model, opts.dtype, opts.device, spec)
        engine = build_engine(generate_config(opts, choice), binding)
        inputs = prompt_inputs(engine, prompt, opts.chat)
        start = time.perf_counter()
        if len(inputs) == 1:
            n_tokens, reason = _stream_one(engine, inputs[0], params)
        else:
            n_tokens, reason = _generate_batch(engine, prompt, inputs, params)
        elapsed = time.perf_counter() - start
    # InvalidRequest, ChatTemplateError, bad dtypes, SpecConfigError and SpecRegistryError are
    # all ValueErrors; a bad draft head directory raises ModelLoadError.
    except (ModelLoadError, TokenizerFileNotFoundError, ValueError) as e:
        fail(e)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        fail("interrupted", code=130)
    rate = n_tokens / elapsed if elapsed > 0 else 0.0
    typer.echo(f"{n_tokens} tokens in {elapsed:.2f} s ({rate:.1f} tok/s), finish: {reason}", err=True)
    summary = spec_summary(engine, binding.name)
    if summary:
        typer.echo(summary, err=True)


def _register_commands() -> None:
    from pdserve import node_cli, tools_cli

    node_cli.register(app)
    tools_cli.register(app)


_register_commands()

if __name__ == "__main__":
    app()
