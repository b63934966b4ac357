"""The node runtime: one `run_node` starts a colocated, prefill or decode node around its role."""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import grpc
from prometheus_client import Histogram

from common.loop_lag import LAG_BUCKETS, start_loop_lag_watch
from engine import kernel_compiles
from engine.engine import Engine
from engine.loop import EngineLoop
from engine.service.server import (
    metrics_suffix,
    node_info,
    scheduler_service,
    serve_until,
    start_server,
    stop_on_signals,
)
from engine.service.servicer import SchedulerServicer
from engine.warmup import warm_before_serving

log = logging.getLogger(__name__)

# the node's event loop serves every gRPC stream: its backlog holds them all (common/loop_lag.py)
NODE_LOOP_LAG = Histogram(
    "pdserve_node_event_loop_lag_seconds",
    "How much later than due a 20-ms timer fired on the node's event loop (its gRPC streams)",
    buckets=LAG_BUCKETS,
)


@dataclass
class RoleParts:
    """What a role adds to the shared runtime once the engine loop runs."""

    handler: Any  # the Generate handler the scheduler servicer calls (see servicer.GenerateHandler)
    info_role: str  # GetModelInfo's role: "prefill", "decode" or "null" (colocated)
    pairing_protocol: str | None = None
    describe: str = ""  # for the start-up log line (the speculative setup)
    runs_prompts: bool = True  # False: a decode node that only continues handed-off requests (no warm-up)
    metrics_source: Any = None  # what /metrics reads the role's PD gauges from (its handler), if any
    # after the servers stop, in order; stopping the engine loop is one of them
    on_stop: list[Callable[[], None]] = field(default_factory=list)
    after: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # awaited last


class NodeRole(Protocol):
    """One role (colocated, prefill, decode): its handler, and the servers and tasks beside the API."""

    name: str  # the metrics label and the log's name: "colocated", "prefill" or "decode"

    def attach(self, loop: EngineLoop, binding: Any, host: str) -> RoleParts:
        """Build the role's handler over the running engine loop (`binding`: the algorithm's);
        whatever it listens on, it listens on `host` only."""
        ...

    async def start(self, host: str, health: Any) -> tuple[list[grpc.aio.Server], str]:
        """Start the role's own servers and tasks; returns them and the READY line's extra fields."""
        ...


async def run_node(
    role: NodeRole,
    build: Callable[[], tuple[Engine, Any]],
    host: str,
    port: int,
    metrics_port: int | None = None,
    served_model_name: str | None = None,
) -> None:
    """Load (`build` returns the engine and its algorithm binding), serve the scheduler API and the
    role's servers, print the READY line, and stop cleanly on SIGINT/SIGTERM."""
    stop = stop_on_signals()  # before the slow load, so no signal is missed
    compiles = kernel_compiles.install()  # start-up's compiles counted too; serving's are logged
    engine, binding = build()
    # The weights' modules, graphs and buffers live as long as the process: out of every later
    # collection, so the scheduler thread's per-step allocations trigger only cheap young ones
    # (a full collection over the engine's objects is milliseconds on the decode path).
    gc.collect()
    gc.freeze()
    try:
        await _serve(role, engine, binding, host, port, metrics_port, served_model_name, stop, compiles)
    finally:
        # Back to the collector: frozen objects are not collected even at exit, so cycles among
        # them that hold native objects (Triton's nanobind bindings) would still be alive when
        # nanobind checks for leaks at shutdown, and it would report each one of them.
        gc.unfreeze()


async def _serve(
    role: NodeRole,
    engine: Engine,
    binding: Any,
    host: str,
    port: int,
    metrics_port: int | None,
    served_model_name: str | None,
    stop: asyncio.Event,
    compiles: kernel_compiles.CompileCounter,
) -> None:
    """Serve until `stop`, then stop cleanly: the servers, the role's steps, the engine loop, and
    last the engine's other tensor-parallel ranks (whatever way serving ended)."""
    loop = EngineLoop(engine).start()
    try:
        parts = role.attach(loop, binding, host)
        # before the API listens: no router sees the node until its prompt path is warm
        if engine.config.prompt_warmup and parts.runs_prompts and not await warm_before_serving(loop, stop):
            await _close(parts, loop)  # stopped while warming up
            return
        info = node_info(engine, parts.info_role, served_model_name, pairing_protocol=parts.pairing_protocol)
        servicer = SchedulerServicer(info, loop, parts.handler, stopping=stop)
        api, api_port = await start_server([scheduler_service(servicer)], host, port, watch=servicer.health)
        servers, extra = await role.start(host, servicer.health)
        log.info(
            "%s node serving %s on %s:%d%s%s",
            role.name,
            engine.config.model,
            host,
            api_port,
            extra,
            f" ({parts.describe})" if parts.describe else "",
        )
        metrics = metrics_suffix(engine, role.name, host, metrics_port, parts.metrics_source)
        print(f"READY scheduler={host}:{api_port}{extra}{metrics}", flush=True)
        compiles.serving = True

        lag = start_loop_lag_watch(NODE_LOOP_LAG.observe)
        try:
            await serve_until(stop, [api, *servers], on_stop=lambda: _stop_steps(parts, loop))
        finally:
            lag.cancel()
        await _after(parts)
    finally:
        loop.stop()  # before the ranks: no step may be sent to followers being stopped
        engine.close()


def _stop_steps(parts: RoleParts, loop: EngineLoop) -> None:
    for step in parts.on_stop or [loop.stop]:
        step()


async def _after(parts: RoleParts) -> None:
    for close in parts.after:
        await close()


async def _close(parts: RoleParts, loop: EngineLoop) -> None:
    """The role's stop steps and closers, for a node stopped before it served."""
    _stop_steps(parts, loop)
    await _after(parts)
