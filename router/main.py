"""The router process: node registry + PD dispatcher + the OpenAI app, served by uvicorn."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
from dataclasses import dataclass, field

import uvicorn

from common.tokenizer import Tokenizer, load_chat_template
from router.app import create_app
from router.breaker import CircuitBreaker
from router.contract import ModelCard
from router.dispatch import PDDispatcher, StageTimeouts
from router.nodes import DnsSource, NodeRegistry, parse_node_lists
from router.policy import make_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    host: str
    port: int
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    colocated: tuple[str, ...] = ()
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_load"
    served_model: str | None = None
    api_keys: frozenset[str] = frozenset()
    max_queue: int = 256
    model_wait_s: float = 120.0
    prefill_dns: tuple[str, ...] = ()  # NAME:PORT,BOOTSTRAP_PORT of a headless service
    decode_dns: tuple[str, ...] = ()
    timeouts: StageTimeouts = field(default_factory=StageTimeouts)
    refresh_s: float = 2.0  # node health/load refresh period
    breaker_failures: int = 3  # consecutive failures that open a node's breaker
    breaker_cooldown_s: float = 10.0  # open -> half-open
    tokenizer: str | None = None  # tokenizer directory; None: the model directory the nodes report
    chat_template: str | None = None  # a template file or inline template replacing the tokenizer's


async def run_router(cfg: RouterConfig) -> None:
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, stop.set)
    dns = [DnsSource.parse("prefill", t) for t in cfg.prefill_dns] + [
        DnsSource.parse("decode", t) for t in cfg.decode_dns
    ]
    if not (cfg.prefill or cfg.decode or cfg.colocated or dns):
        raise ValueError("no nodes: give --prefill/--decode (or --colocated), or their --*-dns forms")
    # Both fail before any waiting for nodes: a bad path or template is a start-up error.
    template = load_chat_template(cfg.chat_template) if cfg.chat_template else None
    own_tokenizer = Tokenizer.from_dir(cfg.tokenizer) if cfg.tokenizer else None
    breaker = functools.partial(CircuitBreaker, cfg.breaker_failures, cfg.breaker_cooldown_s)
    registry = NodeRegistry(
        parse_node_lists(list(cfg.prefill), list(cfg.decode), list(cfg.colocated)),
        dns=dns,
        refresh_s=cfg.refresh_s,
        breaker=breaker,
    )
    # before the first refresh: its listener starts the readiness probe as soon as a pair is up
    dispatcher = PDDispatcher(
        registry,
        make_policy("prefill", cfg.prefill_policy),
        make_policy("decode", cfg.decode_policy),
        timeouts=cfg.timeouts,
    )
    await registry.start()
    try:
        card = await _wait_model(registry, cfg.model_wait_s, stop)
        tokenizer = own_tokenizer or Tokenizer.from_dir(card.tokenizer_path)
        if template is not None:
            tokenizer.set_chat_template(template)
        app = create_app(
            dispatcher,
            tokenizer,
            served_model=cfg.served_model or card.name,
            api_keys=set(cfg.api_keys),
            max_queue=cfg.max_queue,
            metrics_registry=dispatcher.metrics_registry,
        )
        # log_config=None: uvicorn's own lines go through the process's handler (--log-format)
        server = uvicorn.Server(
            uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", log_config=None, lifespan="off")
        )
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else cfg.port
        gc.freeze()  # start-up objects (tokenizer, app, stubs) stay out of every later collection
        print(f"READY http={cfg.host}:{port}", flush=True)
        await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await serving
    finally:
        await dispatcher.close()
        await registry.stop()


async def _wait_model(registry: NodeRegistry, timeout: float, stop: asyncio.Event) -> ModelCard:
    """The model card from the first node that answers; a clear error if none does in time."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        card = registry.model_card()
        if card is not None:
            return card
        if stop.is_set() or asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"no node answered GetModelInfo within {timeout:.0f} s")
        await asyncio.sleep(0.2)
