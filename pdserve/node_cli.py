"""`pdserve serve|prefill|decode|up|router`: long-running processes; flags come from common/config.py.

Torch-free at import like the rest of the CLI; each command imports its role lazily.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from common.config import (
    DecodeRole,
    EngineOptions,
    LogOptions,
    PrefillRole,
    ServeRole,
    SpeculativeOptions,
    UpOptions,
)
from common.defaults import (
    DEFAULT_LOCAL_PREFILL_TPOT_MS,
    check_pd_pooling,
    check_pd_prefill_policy,
    check_rows_place,
    check_sgl_mode,
)
from common.router_options import RouterOptions
from pdserve.errors import fail
from pdserve.flags import with_options


def _setup_logging(log: LogOptions) -> None:
    from common.logs import setup_logging

    try:
        setup_logging(log.log_level, log.log_format)
    except ValueError as e:
        fail(e)


def set_switch_interval(ms: float | None) -> None:
    """The process's GIL switch interval (`--switch-interval-ms`; None keeps Python's)."""
    if ms is None:
        return
    if ms <= 0:
        raise ValueError(f"--switch-interval-ms must be > 0, got {ms:g}")
    sys.setswitchinterval(ms / 1000)


def _run(
    role: Any,
    engine: EngineOptions,
    spec: SpeculativeOptions,
    log: LogOptions,
    host: str,
    port: int,
    metrics_port: int | None,
    tpot_guard_ms: float | None = None,
) -> None:
    """Run a node through engine.service.node.run_node; expected failures are one line and exit 2."""
    import asyncio

    from engine.config import ModelLoadError
    from engine.service.node import run_node
    from engine.service.stream import set_stream_interval
    from pdserve.build import build_node

    _setup_logging(log)
    try:
        set_switch_interval(engine.switch_interval_ms)
        set_stream_interval(engine.stream_interval, engine.stream_messages_per_s)
        asyncio.run(
            run_node(
                role,
                lambda: build_node(engine.for_role(role.name), spec, tpot_guard_ms),
                host,
                port,
                metrics_port,
                served_model_name=engine.served_model_name,
            )
        )
    except (ModelLoadError, ValueError, OSError) as e:
        fail(e)


def _check_before_loading(role: str, engine: EngineOptions, rows_place: str = "kv", sgl_mode: str = "off") -> None:
    """Flag values the model load would only reach later: one line and exit 2, now."""
    from pdserve.tp import check_tp_flags

    try:
        check_tp_flags(engine.tp_size, engine.tp_timeout_s)
        check_rows_place(rows_place)
        check_sgl_mode(sgl_mode)
    except ValueError as e:
        fail(e)


def _check_up_tp(opts: UpOptions) -> None:
    """`up --tp-size`: a size of at least 1, refused before anything starts; the GPU count is
    checked where GPUs are handed out (pdserve/up.py)."""
    from pdserve.tp import check_tp_size

    check_tp_size(opts.tp_size)


def _guard(flag: str, ms: float) -> float:
    """A TPOT guard flag's value (0: off), or a ValueError naming the flag when negative."""
    if ms < 0:
        raise ValueError(f"{flag} must be >= 0, got {ms:g}")
    return ms


def _guard_args(flag: str, guard: float | None) -> tuple[str, ...]:
    """The guard flag `up` passes to one role's nodes alone; a negative guard is refused before
    anything starts."""
    return () if guard is None else (flag, f"{_guard(flag, guard):g}")


def _router_args(opts: UpOptions) -> tuple[str, ...]:
    """The router flags `up` passes on as given; a negative target is refused before anything starts."""
    target = opts.pd_mixed_remote_ttft_target_ms
    if target is None:
        return ()
    if target < 0:
        raise ValueError(f"--pd-mixed-remote-ttft-target-ms must be >= 0, got {target:g}")
    return ("--pd-mixed-remote-ttft-target-ms", f"{target:g}")


def _whole_guard_ms(opts: UpOptions) -> float | None:
    """The prefill nodes' --local-decode-tpot-ms: as given; pooled, the decode nodes' guard when not
    given (a pooled prefill node serves whole requests as a decode node serves its own)."""
    if opts.local_decode_tpot_ms is not None or opts.pd_pooling == "off":
        return opts.local_decode_tpot_ms
    return opts.local_prefill_tpot_ms if opts.local_prefill_tpot_ms is not None else DEFAULT_LOCAL_PREFILL_TPOT_MS


def register(app: typer.Typer) -> None:
    @app.command()
    @with_options(role=ServeRole, engine=EngineOptions, spec=SpeculativeOptions, log=LogOptions)
    def serve(role: ServeRole, engine: EngineOptions, spec: SpeculativeOptions, log: LogOptions) -> None:
        """Colocated node: prompt and decode in one process (the PD baseline)."""
        _check_before_loading("serve", engine)
        from engine.service.colocated import ColocatedRole

        _run(ColocatedRole(), engine, spec, log, role.host, role.port, role.metrics_port)

    @app.command()
    @with_options(role=PrefillRole, engine=EngineOptions, spec=SpeculativeOptions, log=LogOptions)
    def prefill(role: PrefillRole, engine: EngineOptions, spec: SpeculativeOptions, log: LogOptions) -> None:
        """Prefill node: runs prompts (target, then the draft) and writes KV to decode nodes."""
        _check_before_loading("prefill", engine, role.kv_handoff_rows, role.kv_write_sgl)
        from prefill_node.handler import PrefillTimeouts
        from prefill_node.role import PrefillRole as Prefill

        timeouts = PrefillTimeouts(bootstrap_timeout=role.bootstrap_timeout, transfer_timeout=role.transfer_timeout)
        try:
            whole = _guard("--local-decode-tpot-ms", role.local_decode_tpot_ms)
        except ValueError as e:
            fail(e)
        _run(
            Prefill(
                role.bootstrap_port,
                role.kv_transport,
                timeouts,
                role.kv_send_chunks,
                role.kv_handoff_rows,
                role.kv_write_sgl,
                local_decode=whole > 0,
            ),
            engine,
            spec,
            log,
            role.host,
            role.port,
            role.metrics_port,
            tpot_guard_ms=whole or None,
        )

    @app.command()
    @with_options(role=DecodeRole, engine=EngineOptions, spec=SpeculativeOptions, log=LogOptions)
    def decode(role: DecodeRole, engine: EngineOptions, spec: SpeculativeOptions, log: LogOptions) -> None:
        """Decode node: receives KV from prefill nodes and generates."""
        _check_before_loading("decode", engine, role.kv_handoff_rows)
        from decode_node.handler import DecodeTimeouts
        from decode_node.peers import PeerPolicy
        from decode_node.role import DecodeRole as Decode

        policy = PeerPolicy(
            connect_attempts=role.connect_attempts,
            connect_timeout=role.connect_timeout,
            heartbeat_interval=role.heartbeat_interval,
        )
        try:
            local = _guard("--local-prefill-tpot-ms", role.local_prefill_tpot_ms)
        except ValueError as e:
            fail(e)
        _run(
            Decode(
                role.kv_transport,
                DecodeTimeouts(waiting_timeout=role.waiting_timeout),
                policy,
                role.kv_handoff_rows,
                local_prefill_tpot_ms=local,
            ),
            engine,
            spec,
            log,
            role.host,
            role.port,
            role.metrics_port,
            tpot_guard_ms=local or None,
        )

    @app.command()
    @with_options(opts=UpOptions, spec=SpeculativeOptions, log=LogOptions)
    def up(opts: UpOptions, spec: SpeculativeOptions, log: LogOptions) -> None:
        """A local deployment: router + prefill + decode nodes on 127.0.0.1; Ctrl-C stops all."""
        import signal
        import threading

        from rich.console import Console

        from pdserve.up import Deployment, UpConfig, example_curl, served_model

        try:
            check_pd_prefill_policy(opts.pd_prefill_policy)
            check_pd_pooling(opts.pd_pooling, opts.pd_prefill_policy)
            _check_up_tp(opts)
            decode_args = _guard_args("--local-prefill-tpot-ms", opts.local_prefill_tpot_ms)
            prefill_args = _guard_args("--local-decode-tpot-ms", _whole_guard_ms(opts))
            router_args = _router_args(opts)
        except ValueError as e:
            fail(e)

        cfg = UpConfig(
            str(opts.model) if opts.model else None,
            opts.host,
            opts.port,
            opts.prefill,
            opts.decode,
            opts.device,
            tuple(spec.argv()),
            opts.verbose,
            colocated=opts.colocated,
            isolate_gpus=opts.isolate_gpus,
            log_args=("--log-level", log.log_level, "--log-format", log.log_format),
            pd_prefill_policy=opts.pd_prefill_policy,
            pd_pooling=opts.pd_pooling,
            tp_size=opts.tp_size,
            decode_args=decode_args,
            prefill_args=prefill_args,
            router_args=router_args,
        )
        dep, stop = Deployment(cfg), threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        console = Console(stderr=True)
        try:
            with console.status("starting", spinner="dots") as status:
                url = dep.start(lambda msg: status.update(msg))
            typer.echo(f"pdserve is up: {url}  (OpenAI API under {url}/v1)")
            typer.echo(example_curl(url, served_model(url)))
            for name, metrics in dep.metrics_urls().items():  # KV and queue gauges per node
                typer.echo(f"{name} metrics: {metrics}")
            typer.echo("Ctrl-C stops everything.", err=True)
            dead = dep.watch(stop)
            if dead is not None:
                fail(f"{dead} exited unexpectedly; stopping the deployment", code=1)
        except ValueError as e:  # a deployment this machine cannot hold (too few GPUs for --tp-size)
            fail(e)
        except RuntimeError as e:
            fail(e, code=1)
        finally:
            dep.stop()

    @app.command()
    @with_options(options=RouterOptions, log=LogOptions)
    def router(options: RouterOptions, log: LogOptions) -> None:
        """The OpenAI-compatible router in front of prefill/decode (and colocated) nodes."""
        from router.main import serve_router

        _setup_logging(log)
        try:  # not _run: that one knows engine errors, and the router must not import the engine
            serve_router(options)
        except (RuntimeError, ValueError, OSError) as e:
            fail(e)
