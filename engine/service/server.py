"""Starting and stopping a node's gRPC server (scheduler API, extra services, standard health)."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from engine.service.health import HealthWatch
from engine.service.servicer import NodeInfo

log = logging.getLogger(__name__)

# (add_XServicer_to_server, servicer, full service name for health)
ServiceSpec = tuple[Callable[[Any, grpc.aio.Server], None], Any, str]


def node_info(engine: Any, role: str, served_name: str | None = None, pairing_protocol: str | None = None) -> NodeInfo:
    cfg, mc = engine.config, engine.model_config
    path = str(Path(cfg.model).resolve())
    return NodeInfo(
        served_model_name=served_name or Path(cfg.model).name,
        model_path=path,
        tokenizer_path=path,
        max_context_length=engine.max_context_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=list(mc.eos_token_ids),
        architectures=[mc.architecture],
        model_type=str(mc.raw.get("model_type", "")),
        role=role,
        pairing_protocol=pairing_protocol,
        server_args={
            "page_size": cfg.page_size,
            "max_running_requests": cfg.max_running,
            "tp_size": cfg.tp_size,
            "dp_size": 1,
        },
    )


async def start_server(
    services: list[ServiceSpec], host: str, port: int, watch: HealthWatch | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the bound port (port 0 picks a free one). With a
    `watch`, standard gRPC health follows its verdict (NOT_SERVING while the node cannot serve)."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add, servicer, _ in services:
        add(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    names = [name for _, _, name in services] + [""]
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if watch is not None:
        task = asyncio.create_task(watch.run(health_servicer, names), name="health-watch")
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
    return server, bound


_BACKGROUND: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks


def scheduler_service(servicer: Any) -> ServiceSpec:
    return (pb_grpc.add_SglangSchedulerServicer_to_server, servicer, "sglang.grpc.scheduler.SglangScheduler")


def metrics_suffix(engine: Any, role: str, host: str, port: int | None, handler: Any = None) -> str:
    """Start /metrics when asked; the READY line then names its port too."""
    if port is None:
        return ""
    from engine.service.metrics import start_metrics

    return f" metrics={host}:{start_metrics(engine, role, host, port, handler)}"


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM; install it before anything slow so no signal is missed."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until(
    stop: asyncio.Event, servers: list[grpc.aio.Server], on_stop: Callable[[], None] | None = None, grace_s: float = 5.0
) -> None:
    """Block until `stop`, then stop accepting and let in-flight calls finish (bounded)."""
    await stop.wait()
    log.info("shutting down")
    await asyncio.gather(*(s.stop(grace_s) for s in servers))
    if on_stop is not None:
        on_stop()
