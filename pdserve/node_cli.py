"""`pdserve serve|prefill|decode`: long-running node processes behind the SGLang scheduler API.

Torch-free at import like the rest of the CLI; each command imports its role lazily.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

if TYPE_CHECKING:
    from engine.engine import Engine

PANEL_SPEC = "Speculative decoding"
ModelOpt = Annotated[Optional[Path], typer.Option(
    help="HF-format model directory (default: the built-in Python-code pair, with EAGLE on).")]
HostOpt = Annotated[str, typer.Option(help="Address to bind.")]
DTypeOpt = Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16.")]
DeviceOpt = Annotated[str, typer.Option(help="torch device, e.g. cpu or cuda:0.")]
PageOpt = Annotated[int, typer.Option(help="Tokens per KV cache page.")]
TotalOpt = Annotated[int, typer.Option(help="KV cache capacity in tokens.")]
RunningOpt = Annotated[int, typer.Option(help="Most requests in flight.")]
ChunkOpt = Annotated[int, typer.Option(help="Prefill token budget per step (chunked prefill).")]
MetricsOpt = Annotated[Optional[int], typer.Option(help="Serve Prometheus /metrics on this port (0: any free).")]
AlgoOpt = Annotated[Optional[str], typer.Option(
    help="NONE, EAGLE, EAGLE3 or a plugin such as NGRAM (default: EAGLE with the built-in pair, "
         "else NONE).", rich_help_panel=PANEL_SPEC)]
DraftOpt = Annotated[Optional[Path], typer.Option(help="Draft head directory (EAGLE/EAGLE3).",
                                                  rich_help_panel=PANEL_SPEC)]
IntSpecOpt = Annotated[Optional[int], typer.Option(rich_help_panel=PANEL_SPEC)]
AdaptiveOpt = Annotated[bool, typer.Option(
    help="Adapt the draft steps to the batch size and the acceptance seen (EAGLE chains).",
    rich_help_panel=PANEL_SPEC)]
AdaptiveConfigOpt = Annotated[Optional[Path], typer.Option(
    help="JSON of candidate steps per batch-size range (default: the built-in one; spec/adaptive).",
    rich_help_panel=PANEL_SPEC)]
PANEL_FAST = "GPU fast path"
BackendOpt = Annotated[str, typer.Option(
    help="Attention backend: auto (triton on GPUs, torch on CPU), torch or triton.",
    rich_help_panel=PANEL_FAST)]
OverlapOpt = Annotated[Optional[bool], typer.Option(
    help="Overlap scheduling (default: on for GPUs, off on CPU).", rich_help_panel=PANEL_FAST)]
GraphOpt = Annotated[Optional[int], typer.Option(
    help="Largest batch served from CUDA graphs; 0 disables (default: min(max-running, 64) on "
         "GPUs).", rich_help_panel=PANEL_FAST)]
DebugOpt = Annotated[bool, typer.Option(
    help="FutureMap debug mode: poison consumed rows and check every read.", rich_help_panel=PANEL_FAST)]


@dataclass
class EngineOptions:
    model: Optional[Path]
    dtype: Optional[str]
    device: str
    page_size: int
    max_total_tokens: int
    max_running: int
    chunked_prefill_size: int
    speculative_algorithm: Optional[str]
    speculative_draft_model_path: Optional[Path]
    speculative_num_steps: Optional[int]
    speculative_eagle_topk: Optional[int]
    speculative_num_draft_tokens: Optional[int]
    speculative_adaptive: bool = False
    speculative_adaptive_config: Optional[Path] = None
    attention_backend: str = "auto"
    overlap: Optional[bool] = None
    cuda_graph_max_bs: Optional[int] = None
    future_map_debug: bool = False

    def fast_path(self) -> dict[str, Any]:
        """EngineConfig fields of the GPU fast path: Triton attention, overlap and CUDA graphs by
        default on GPUs; the CPU keeps the torch reference path (nothing to overlap or capture)."""
        gpu = self.device.startswith("cuda")
        backend = self.attention_backend if self.attention_backend != "auto" else (
            "triton" if gpu else "torch")
        graphs = self.cuda_graph_max_bs if self.cuda_graph_max_bs is not None else (
            min(self.max_running, 64) if gpu else 0)
        return {"attention_backend": backend, "overlap": gpu if self.overlap is None else self.overlap,
                "cuda_graph_max_bs": graphs, "future_map_debug": self.future_map_debug}

    def build(self) -> tuple["Engine", Any]:
        """Load the engine for a node (threaded scheduler IO); returns (engine, algorithm binding)."""
        from engine.engine import Engine, EngineConfig, check_device
        from engine.loop import ThreadedIO
        from pdserve.cli import bind_algorithm, spec_config
        from pdserve.models import resolve

        check_device(self.device)
        choice = resolve(self.model, algorithm=self.speculative_algorithm,
                         draft_model_path=self.speculative_draft_model_path,
                         num_steps=self.speculative_num_steps, dtype=self.dtype, device=self.device,
                         adaptive=self.speculative_adaptive)
        spec = spec_config(choice.algorithm, draft_model_path=choice.draft_model_path,
                           num_steps=choice.num_steps, eagle_topk=self.speculative_eagle_topk,
                           num_draft_tokens=self.speculative_num_draft_tokens,
                           adaptive=self.speculative_adaptive or None,
                           adaptive_config=self.speculative_adaptive_config)
        binding = bind_algorithm(spec)
        cfg = EngineConfig(model=str(choice.model), dtype=choice.dtype,
                           device=self.device, page_size=self.page_size,
                           max_total_tokens=self.max_total_tokens, max_running=self.max_running,
                           chunked_prefill_size=self.chunked_prefill_size, **self.fast_path())
        return Engine(cfg, algorithm=binding, io=ThreadedIO()), binding


def _run(main: Any) -> None:
    """Run a node's asyncio main; expected failures are one line and exit 2."""
    import asyncio

    from engine.config import ModelLoadError
    from pdserve.cli import _fail

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(main)
    except (ModelLoadError, ValueError, OSError) as e:
        _fail(e)


TransportOpt = Annotated[str, typer.Option(help="KV transfer backend (nixl).")]


def with_engine_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Give a node command the engine and speculative options every role shares.

    The command declares only its own options plus an `opts: EngineOptions` parameter; the
    shared ones are appended to its signature (typer reads `__signature__`) and folded into
    one EngineOptions before the command runs."""
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default)
              for name, ann, default in _ENGINE_PARAMS]
    own = [p for p in inspect.signature(fn).parameters.values() if p.name != "opts"]

    @functools.wraps(fn)
    def command(**kwargs: Any) -> None:
        opts = EngineOptions(**{name: kwargs.pop(name) for name, _, _ in _ENGINE_PARAMS})
        fn(opts=opts, **kwargs)

    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared)
    return command


_ENGINE_PARAMS: list[tuple[str, Any, Any]] = [
    ("model", ModelOpt, None), ("dtype", DTypeOpt, None), ("device", DeviceOpt, "cpu"),
    ("page_size", PageOpt, 16), ("max_total_tokens", TotalOpt, 16384), ("max_running", RunningOpt, 64),
    ("chunked_prefill_size", ChunkOpt, 2048), ("speculative_algorithm", AlgoOpt, None),
    ("speculative_draft_model_path", DraftOpt, None), ("speculative_num_steps", IntSpecOpt, None),
    ("speculative_eagle_topk", IntSpecOpt, None), ("speculative_num_draft_tokens", IntSpecOpt, None),
    ("speculative_adaptive", AdaptiveOpt, False), ("speculative_adaptive_config", AdaptiveConfigOpt, None),
    ("attention_backend", BackendOpt, "auto"), ("overlap", OverlapOpt, None),
    ("cuda_graph_max_bs", GraphOpt, None), ("future_map_debug", DebugOpt, False),
]
PortHelp = "Scheduler API (gRPC) port."


def register(app: typer.Typer) -> None:
    @app.command()
    @with_engine_options
    def serve(opts: EngineOptions, host: HostOpt = "127.0.0.1",
              port: Annotated[int, typer.Option(help=PortHelp)] = 30000,
              metrics_port: MetricsOpt = None) -> None:
        """Colocated node: prompt and decode in one process (the PD baseline)."""
        from engine.service.colocated import run_colocated

        _run(run_colocated(opts, host, port, metrics_port))

    @app.command()
    @with_engine_options
    def prefill(
        opts: EngineOptions, host: HostOpt = "127.0.0.1",
        port: Annotated[int, typer.Option(help=PortHelp)] = 30001,
        bootstrap_port: Annotated[int, typer.Option(help="KV control port decode nodes connect to.")] = 8998,
        kv_transport: TransportOpt = "nixl",
        bootstrap_timeout: Annotated[float, typer.Option(help="Seconds to wait for a destination.")] = 30.0,
        transfer_timeout: Annotated[float, typer.Option(help="Seconds a KV write may take.")] = 30.0,
        metrics_port: MetricsOpt = None,
    ) -> None:
        """Prefill node: runs prompts (target, then the draft) and writes KV to decode nodes."""
        from prefill_node.handler import PrefillTimeouts
        from prefill_node.main import run_prefill

        _run(run_prefill(opts, host, port, bootstrap_port, kv_transport,
                         PrefillTimeouts(bootstrap_s=bootstrap_timeout, transfer_s=transfer_timeout),
                         metrics_port))

    @app.command()
    @with_engine_options
    def decode(
        opts: EngineOptions, host: HostOpt = "127.0.0.1",
        port: Annotated[int, typer.Option(help=PortHelp)] = 30002,
        kv_transport: TransportOpt = "nixl",
        waiting_timeout: Annotated[float, typer.Option(help="Seconds to wait for a prefill's KV.")] = 60.0,
        connect_attempts: Annotated[int, typer.Option(help="Handshake attempts per prefill.")] = 8,
        connect_timeout: Annotated[float, typer.Option(help="Total seconds to reach a prefill.")] = 30.0,
        heartbeat_interval: Annotated[float, typer.Option(help="Seconds between prefill health checks.")] = 2.0,
        metrics_port: MetricsOpt = None,
    ) -> None:
        """Decode node: receives KV from prefill nodes and generates."""
        from decode_node.handler import DecodeTimeouts
        from decode_node.main import run_decode
        from decode_node.peers import PeerPolicy

        _run(run_decode(opts, host, port, kv_transport, DecodeTimeouts(waiting_s=waiting_timeout),
                        PeerPolicy(connect_attempts=connect_attempts, connect_total_s=connect_timeout,
                                   heartbeat_s=heartbeat_interval), metrics_port))

    @app.command()
    def up(
        model: ModelOpt = None, host: HostOpt = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Router HTTP port (OpenAI API).")] = 8000,
        prefill: Annotated[int, typer.Option(help="Number of prefill nodes.")] = 1,
        decode: Annotated[int, typer.Option(help="Number of decode nodes.")] = 1,
        colocated: Annotated[int, typer.Option(
            help="Run this many colocated nodes instead of prefill/decode (the PD baseline).")] = 0,
        device: Annotated[str, typer.Option(help="auto (GPUs when present), cpu or cuda.")] = "auto",
        speculative_algorithm: AlgoOpt = None, speculative_draft_model_path: DraftOpt = None,
        speculative_num_steps: IntSpecOpt = None, speculative_adaptive: AdaptiveOpt = False,
        verbose: Annotated[bool, typer.Option("--verbose", help="Echo the nodes' logs.")] = False,
    ) -> None:
        """A local deployment: router + prefill + decode nodes on 127.0.0.1; Ctrl-C stops all."""
        import signal
        import threading

        from rich.console import Console

        from pdserve.cli import _fail
        from pdserve.up import Deployment, UpConfig, example_curl, served_model

        node_args: list[str] = []
        if speculative_algorithm is not None:
            node_args += ["--speculative-algorithm", speculative_algorithm]
        if speculative_draft_model_path is not None:
            node_args += ["--speculative-draft-model-path", str(speculative_draft_model_path)]
        if speculative_num_steps is not None:
            node_args += ["--speculative-num-steps", str(speculative_num_steps)]
        if speculative_adaptive:
            node_args += ["--speculative-adaptive"]
        cfg = UpConfig(str(model) if model else None, host, port, prefill, decode, device,
                       tuple(node_args), verbose, colocated=colocated)
        dep, stop = Deployment(cfg), threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        console = Console(stderr=True)
        try:
            with console.status("starting", spinner="dots") as status:
                url = dep.start(lambda msg: status.update(msg))
            typer.echo(f"pdserve is up: {url}  (OpenAI API under {url}/v1)")
            typer.echo(example_curl(url, served_model(url)))
            typer.echo("Ctrl-C stops everything.", err=True)
            dead = dep.watch(stop)
            if dead is not None:
                _fail(f"{dead} exited unexpectedly; stopping the deployment", code=1)
        except RuntimeError as e:
            _fail(e, code=1)
        finally:
            dep.stop()

    @app.command()
    def router(
        host: HostOpt = "127.0.0.1",
        port: Annotated[int, typer.Option(help="HTTP port of the OpenAI API.")] = 8000,
        prefill: Annotated[Optional[list[str]], typer.Option(
            help="Prefill node HOST:PORT,BOOTSTRAP_PORT (repeatable).")] = None,
        decode: Annotated[Optional[list[str]], typer.Option(help="Decode node HOST:PORT (repeatable).")] = None,
        colocated: Annotated[Optional[list[str]], typer.Option(
            help="Colocated node HOST:PORT, used when no PD pair is available (repeatable).")] = None,
        prefill_policy: Annotated[str, typer.Option(help="round_robin, least_load or prefix_aware.")] = "prefix_aware",
        decode_policy: Annotated[str, typer.Option(help="round_robin or least_load.")] = "least_load",
        served_model: Annotated[Optional[str], typer.Option(help="Model id clients send (default: the nodes').")] = None,
        api_key: Annotated[Optional[list[str]], typer.Option(help="Accepted API key (repeatable).")] = None,
        max_queue: Annotated[int, typer.Option(help="Most requests in flight before 503.")] = 256,
        prefill_dns: Annotated[Optional[list[str]], typer.Option(
            help="Headless service NAME:PORT,BOOTSTRAP_PORT whose addresses are prefill nodes.")] = None,
        decode_dns: Annotated[Optional[list[str]], typer.Option(
            help="Headless service NAME:PORT whose addresses are decode nodes.")] = None,
        first_token_timeout: Annotated[float, typer.Option(
            help="Seconds from sending a request to its first decode message (prefill + transfer).")] = 90.0,
        inter_token_timeout: Annotated[float, typer.Option(help="Seconds between two decode messages.")] = 60.0,
        prefill_timeout: Annotated[float, typer.Option(help="Seconds for a whole prefill leg.")] = 60.0,
        refresh_interval: Annotated[float, typer.Option(help="Seconds between node health/load refreshes.")] = 2.0,
        breaker_failures: Annotated[int, typer.Option(
            help="Consecutive failures that open a node's circuit breaker.")] = 3,
        breaker_cooldown: Annotated[float, typer.Option(
            help="Seconds an open breaker waits before letting one request probe the node.")] = 10.0,
    ) -> None:
        """The OpenAI-compatible router in front of prefill/decode (and colocated) nodes."""
        import asyncio

        from pdserve.cli import _fail
        from router.dispatch import StageTimeouts
        from router.main import RouterConfig, run_router

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:  # not _run: that one knows engine errors, and the router must not import the engine
            asyncio.run(run_router(RouterConfig(host, port, tuple(prefill or ()), tuple(decode or ()),
                                     tuple(colocated or ()), prefill_policy, decode_policy, served_model,
                                     frozenset(api_key or ()), max_queue,
                                     prefill_dns=tuple(prefill_dns or ()), decode_dns=tuple(decode_dns or ()),
                                     timeouts=StageTimeouts(prefill_s=prefill_timeout,
                                                            first_token_s=first_token_timeout,
                                                            inter_token_s=inter_token_timeout),
                                     refresh_s=refresh_interval, breaker_failures=breaker_failures,
                                     breaker_cooldown_s=breaker_cooldown)))
        except (RuntimeError, ValueError, OSError) as e:
            _fail(e)
