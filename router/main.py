"""The router process: node registry + PD dispatcher + the OpenAI app, served by uvicorn."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
from typing import Any, Callable, Coroutine

import uvicorn
from fastapi import FastAPI

from common.loop_lag import start_loop_lag_watch
from common.router_options import RouterOptions
from common.tokenizer import Tokenizer, load_chat_template
from router.app import RouterApp
from router.breaker import CircuitBreaker
from router.contract import ModelCard
from router.dispatch import PDDispatcher, StageTimeouts
from router.kv_index import KvIndex
from router.nodes import DnsSource, NodeRegistry, parse_node_lists
from router.policy import make_policy
from router.path_rule import PathRule
from router.tools.registry import parser_named

log = logging.getLogger(__name__)

MODEL_WAIT_S = 120.0  # how long start-up waits for a node to report its model


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def serve_router(options: RouterOptions) -> None:
    """run_router on the event loop --event-loop names: uvloop (auto: where it is installed) runs
    the router's HTTP and gRPC legs with less CPU a request than asyncio's own loop."""
    _loop_runner(options.event_loop)(run_router(options))


def _loop_runner(choice: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    if choice not in EVENT_LOOPS:
        raise ValueError(f"--event-loop {choice!r}: choose one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed (pip install 'pdserve[router]')") from None
        return asyncio.run
    return uvloop.run


async def run_router(options: RouterOptions) -> None:
    """Serve the OpenAI API until SIGINT or SIGTERM. Bad settings (no nodes, a bad tokenizer or chat
    template) raise before any waiting for nodes; no node reporting its model in time raises too."""
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, stop.set)
    dns = _dns_sources(options)
    # Both fail before any waiting for nodes: a bad path or template is a start-up error.
    template = load_chat_template(options.chat_template) if options.chat_template else None
    own_tokenizer = Tokenizer.from_dir(options.tokenizer) if options.tokenizer else None
    if options.tool_call_parser:
        parser_named(options.tool_call_parser)  # an unknown name fails here, not after the wait
    if options.stream_messages_per_s < 0:
        raise ValueError(f"--stream-messages-per-s must be >= 0, got {options.stream_messages_per_s:g}")
    if options.prompt_prefix_cache_mb < 0:
        raise ValueError(f"--prompt-prefix-cache-mb must be >= 0, got {options.prompt_prefix_cache_mb:g}")
    # the nodes' KV event streams are followed only for a policy that reads them
    index = KvIndex() if "prefix_aware" in (options.prefill_policy, options.decode_policy) else None
    registry = NodeRegistry(
        parse_node_lists(options.prefill, options.decode, options.colocated),
        dns=dns,
        refresh_interval=options.refresh_interval,
        breaker=functools.partial(CircuitBreaker, options.breaker_failures, options.breaker_cooldown),
        followers=[index] if index is not None else [],
    )
    # before the first refresh: its listener starts the readiness probe as soon as a pair is up
    dispatcher = PDDispatcher(
        registry,
        make_policy("prefill", options.prefill_policy, index),
        make_policy("decode", options.decode_policy, index),
        timeouts=_timeouts(options),
        path_policy=options.pd_prefill_policy,
        kv_index=index,
        path_rule=path_rule(options),
        pooling=options.pd_pooling,
        stream_messages_per_s=options.stream_messages_per_s,
    )
    await registry.start()
    try:
        card = await _wait_model(registry, MODEL_WAIT_S, stop)
        tokenizer = own_tokenizer or Tokenizer.from_dir(card.tokenizer_path)
        if template is not None:
            tokenizer.set_chat_template(template)
        router = RouterApp(
            dispatcher,
            tokenizer,
            served_model=options.served_model or card.name,
            api_keys=options.api_keys,
            max_queue=options.max_queue,
            metrics_registry=dispatcher.metrics_registry,
            tool_call_parser=options.tool_call_parser,
            prefix_token_bytes=int(options.prompt_prefix_cache_mb * (1 << 20)),
        )
        lag = start_loop_lag_watch(router.metrics.loop_lag.observe)
        try:
            await _serve(router.app, options, stop)
        finally:
            lag.cancel()
    finally:
        await dispatcher.close()
        await registry.stop()


def _dns_sources(options: RouterOptions) -> list[DnsSource]:
    """The headless-service names of --prefill-dns/--decode-dns; ValueError when no node is named at all."""
    dns = [DnsSource.parse("prefill", t) for t in options.prefill_dns] + [
        DnsSource.parse("decode", t) for t in options.decode_dns
    ]
    if not (options.prefill or options.decode or options.colocated or dns):
        raise ValueError("no nodes: give --prefill/--decode (or --colocated), or their --*-dns forms")
    return dns


def path_rule(options: RouterOptions) -> PathRule:
    """`auto`'s thresholds from the router's flags (the rest at PathRule's defaults)."""
    return PathRule(
        local_max_tokens=options.pd_local_max_tokens,
        remote_target_s=options.pd_remote_ttft_target_ms / 1e3,
        mixed_remote_target_s=options.pd_mixed_remote_ttft_target_ms / 1e3,
    )


def _timeouts(options: RouterOptions) -> StageTimeouts:
    """The stage timeouts the flags set; the others keep StageTimeouts' own values."""
    return StageTimeouts(
        prefill_timeout=options.prefill_timeout,
        first_token_timeout=options.first_token_timeout,
        inter_token_timeout=options.inter_token_timeout,
    )


async def _serve(app: FastAPI, options: RouterOptions, stop: asyncio.Event) -> None:
    """Serve `app` until `stop` is set (or the server ends); prints READY with the bound port."""
    # log_config=None: uvicorn's own lines go through the process's handler (--log-format)
    server = uvicorn.Server(
        uvicorn.Config(app, host=options.host, port=options.port, log_level="warning", log_config=None, lifespan="off")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else options.port
    gc.freeze()  # start-up objects (tokenizer, app, stubs) stay out of every later collection
    print(f"READY http={options.host}:{port}", flush=True)
    await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    await serving


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
