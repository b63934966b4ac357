"""The router's view of its nodes: the configured list, one gRPC client per node, and a
background refresh (health, model card, pairing fingerprint, load) that marks nodes up or down.

Nodes speak the SGLang scheduler API (`SglangScheduler`). A prefill's bootstrap port is not in its
server info, so the operator names it next to the address, as SMG does
(`--prefill host:port,BOOTSTRAP_PORT`). The translation between router jobs/events and the
scheduler API's messages is router/wire.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import grpc
from google.protobuf import json_format
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc

from common.defaults import DEFAULT_BOOTSTRAP_PORT, DEFAULT_REFRESH_INTERVAL
from router.breaker import CircuitBreaker
from router.contract import ModelCard
from router.perf import NodePerf, PromptLedger, TtftCalibration

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")
# GetServerInfo's disaggregation_mode for each configured role; a mismatch is a config error.
SERVER_MODE = {"prefill": "prefill", "decode": "decode", "colocated": "null"}
# Fast reconnects: the default backoff grows to 120 s, far slower than the refresh period.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
]


@dataclass(frozen=True)
class NodeSpec:
    role: str  # "prefill" | "decode" | "colocated"
    address: str  # host:port of its SglangScheduler service
    bootstrap_port: int | None = None  # prefills only

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown node role {self.role!r} (expected one of {', '.join(ROLES)})")

    @property
    def host(self) -> str:
        """What a decode node dials for the KV handshake: the prefill address without its port."""
        host = self.address.rsplit(":", 1)[0]
        return host[1:-1] if host.startswith("[") else host


def _address(text: str) -> str:
    text = text.strip()
    for scheme in ("grpc://", "http://"):
        text = text.removeprefix(scheme)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"node address {text!r} is not host:port")
    return text


def parse_node_lists(prefill: Sequence[str], decode: Sequence[str], colocated: Sequence[str] = ()) -> list[NodeSpec]:
    """CLI-style node lists: prefill entries are "host:port[,bootstrap_port]" (a space works too,
    as in SMG's `--prefill URL PORT`), decode and colocated entries are "host:port"."""
    specs: list[NodeSpec] = []
    for entry in prefill:
        parts = entry.replace(",", " ").split()
        if not parts or len(parts) > 2:
            raise ValueError(f"prefill entry {entry!r} is not host:port[,bootstrap_port]")
        boot = int(parts[1]) if len(parts) == 2 else DEFAULT_BOOTSTRAP_PORT
        specs.append(NodeSpec("prefill", _address(parts[0]), boot))
    specs += [NodeSpec("decode", _address(e)) for e in decode]
    specs += [NodeSpec("colocated", _address(e)) for e in colocated]
    seen: set[str] = set()
    for s in specs:
        if s.address in seen:
            raise ValueError(f"node {s.address} is listed twice")
        seen.add(s.address)
    return specs


def resolve_headless(name: str, port: int) -> list[str]:
    """Every address behind a DNS name (a Kubernetes headless service lists one per pod)."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})  # IPv4/IPv6 sockaddrs: (host, port, ...)
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


@dataclass
class NodeState:
    """What the router knows about one node; policies read it, the registry and dispatcher write it."""

    spec: NodeSpec
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    stub: pb_grpc.SglangSchedulerStub | None = None
    healthy: bool = False
    pairing_protocol: str | None = None  # None: the node names none, and then pairs with any
    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    inflight: int = 0  # this router's requests on the node not yet finished
    error: str = ""
    last_seen: float = 0.0
    # What the prefill path decision reads (router/prefill_path.py); unknown until the node reports it.
    perf: NodePerf = field(default_factory=NodePerf)
    local_prefill: bool = False  # a decode that runs prompts sent to it without a prefill
    local_decode: bool = False  # a prefill that runs requests sent to it without a decode, whole
    waiting_prompt_tokens: int = 0  # prompt tokens queued on the node, not computed yet
    max_tokens: int = 0  # KV cache capacity in tokens (0: not reported)
    kv_transfer_s: float = 0.0  # what a prefill reports its handoffs add to a TTFT (0: unknown)
    page_size: int = 0  # tokens per KV page, from GetServerInfo's server_args (0: not reported)
    loads_at: float = 0.0  # monotonic time the last load report was asked for
    prompts: PromptLedger = field(default_factory=PromptLedger)  # our prompts without a first token yet
    ttft: TtftCalibration = field(default_factory=TtftCalibration)  # its prompts' observed / estimated TTFT

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def load(self) -> int:
        """Outstanding requests: what the node reported plus what we sent since."""
        return self.running + self.waiting + self.inflight

    def usable(self) -> bool:
        return self.healthy and self.breaker.available()


def compatible(a: NodeState, b: NodeState) -> bool:
    """SMG's rule: different pairing protocols never pair; a node naming none pairs with any."""
    return a.pairing_protocol is None or b.pairing_protocol is None or a.pairing_protocol == b.pairing_protocol


def _model_card(info: pb.GetModelInfoResponse) -> ModelCard:
    return ModelCard(
        name=info.served_model_name or info.model_path,
        tokenizer_path=info.tokenizer_path or info.model_path,
        max_context_length=info.max_context_length,
        eos_token_ids=tuple(info.eos_token_ids),
    )


@dataclass(frozen=True)
class DnsSource:
    """Nodes of one role behind a DNS name (a Kubernetes headless service), re-resolved each refresh."""

    role: str
    name: str
    port: int
    bootstrap_port: int | None = None

    @staticmethod
    def parse(role: str, text: str) -> "DnsSource":
        """'name:port' (decode/colocated) or 'name:port,bootstrap_port' (prefill)."""
        target, _, boot = text.partition(",")
        name, _, port = target.rpartition(":")
        if not name or not port.isdigit() or (boot and not boot.isdigit()):
            raise ValueError(
                f"bad --{role}-dns {text!r}: expected NAME:PORT" + (",BOOTSTRAP_PORT" if role == "prefill" else "")
            )
        return DnsSource(
            role, name, int(port), int(boot) if boot else (DEFAULT_BOOTSTRAP_PORT if role == "prefill" else None)
        )


class Follower(Protocol):
    """Keeps something per node beside the refresh (router/kv_index.py's event streams)."""

    def sync(self, states: Sequence[NodeState]) -> None:
        """The registry's nodes now (each with its stub): follow new ones, forget gone ones."""

    async def stop(self) -> None: ...


class NodeRegistry:
    """One channel and stub per node, refreshed every `refresh_interval` seconds by a background task. Nodes come
    from static specs and from DNS sources. A DNS-discovered address that no longer resolves is
    forgotten once no request of ours runs on it (a draining pod keeps its streams), so pods that
    come and go leave no channels or metric series behind; static nodes are never forgotten."""

    def __init__(
        self,
        specs: Iterable[NodeSpec],
        *,
        refresh_interval: float = DEFAULT_REFRESH_INTERVAL,
        rpc_timeout_s: float = 1.0,
        breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
        dns: Iterable[DnsSource] = (),
        followers: Iterable[Follower] = (),
    ) -> None:
        self.refresh_interval, self.rpc_timeout_s = refresh_interval, rpc_timeout_s
        self._breaker = breaker
        self.dns = list(dns)
        self.followers = list(followers)  # synced after each round's connect, stopped with the registry
        self.states = [NodeState(spec, breaker()) for spec in specs]
        self.card: ModelCard | None = None
        self.listeners: list[Callable[[], None]] = []  # called after each refresh round
        self._channels: dict[str, grpc.aio.Channel] = {}  # by node address
        self._discovered: dict[tuple[str, str], str] = {}  # (role, address) -> DNS name it came from
        self._task: asyncio.Task[None] | None = None
        self._soon: dict[str, asyncio.Task[None]] = {}  # one-node refreshes in flight, by address

    def refresh_soon(self, s: NodeState) -> None:
        """Re-read one node's health, server info and load now, not at the next round (a node that
        just ran its first prompts reports its rates); one such read in flight per node."""
        if s.stub is None or s.address in self._soon:
            return
        task = asyncio.get_running_loop().create_task(self._refresh(s), name=f"refresh-{s.address}")
        self._soon[s.address] = task
        task.add_done_callback(lambda _: self._soon.pop(s.address, None))

    def nodes(self, role: str, *, healthy_only: bool = True) -> list[NodeState]:
        return [s for s in self.states if s.role == role and (s.healthy or not healthy_only)]

    def get(self, address: str) -> NodeState:
        return next(s for s in self.states if s.address == address)

    def model_card(self) -> ModelCard | None:
        return self.card

    def _connect(self) -> None:
        """Channels belong to the running event loop, so they are made on first use, not in __init__."""
        for s in self.states:
            if s.stub is None:
                channel = grpc.aio.insecure_channel(s.address, options=CHANNEL_OPTIONS)
                self._channels[s.address] = channel
                s.stub = pb_grpc.SglangSchedulerStub(channel)

    async def start(self) -> None:
        """First refresh now (so the router starts knowing its nodes), then keep refreshing."""
        await self.refresh_once()
        self._task = asyncio.create_task(self._loop(), name="node-refresh")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._soon.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        for follower in self.followers:  # before the channels they read close
            await follower.stop()
        await asyncio.gather(*(c.close() for c in self._channels.values()), return_exceptions=True)
        self._channels.clear()
        for s in self.states:
            s.stub, s.healthy = None, False

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                await self.refresh_once()
            except Exception:  # a bug here must not stop the refresh for good
                log.exception("node refresh failed")

    async def discover(self) -> None:
        """Add the addresses DNS names resolve to now and forget idle ones that vanished (a failed
        lookup keeps what we know)."""
        known = {(st.role, st.address) for st in self.states}
        for src in self.dns:
            try:
                addrs = await asyncio.to_thread(resolve_headless, src.name, src.port)
            except OSError as e:
                log.warning("DNS lookup of %s failed: %s", src.name, e)
                continue
            for addr in addrs:
                if (src.role, addr) not in known:
                    log.info("discovered %s node %s via %s", src.role, addr, src.name)
                    self.states.append(NodeState(NodeSpec(src.role, addr, src.bootstrap_port), self._breaker()))
                    self._discovered[(src.role, addr)] = src.name
                    known.add((src.role, addr))
            await self._forget_vanished(src, set(addrs))

    async def _forget_vanished(self, src: DnsSource, resolved: set[str]) -> None:
        gone = [
            st
            for st in self.states
            if st.role == src.role
            and st.address not in resolved
            and self._discovered.get((st.role, st.address)) == src.name
            and st.inflight == 0
        ]
        for st in gone:
            log.info("forgetting %s node %s: %s no longer lists it", st.role, st.address, src.name)
            self.states.remove(st)
            del self._discovered[(st.role, st.address)]
            channel = self._channels.pop(st.address, None)
            st.stub, st.healthy = None, False
            if channel is not None:
                await channel.close()

    async def refresh_once(self) -> None:
        await self.discover()
        self._connect()
        for follower in self.followers:
            follower.sync(self.states)
        await asyncio.gather(*(self._refresh(s) for s in self.states))
        for listener in self.listeners:
            listener()

    async def _refresh(self, s: NodeState) -> None:
        assert s.stub is not None
        t = self.rpc_timeout_s
        was = s.healthy
        try:
            health = await s.stub.HealthCheck(pb.HealthCheckRequest(), timeout=t)
            if not health.healthy:
                raise _Down(f"unhealthy: {health.message}")
            if self.card is None:
                self.card = _model_card(await s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=t))
            await self._server_info(s)
            await self._loads(s)
        except (grpc.aio.AioRpcError, _Down, asyncio.TimeoutError) as e:
            s.healthy, s.error = False, _describe(e)
        else:
            s.healthy, s.error, s.last_seen = True, "", time.monotonic()
        if s.healthy != was:
            log.log(
                logging.INFO if s.healthy else logging.WARNING,
                "%s node %s is %s%s",
                s.role,
                s.address,
                "up" if s.healthy else "down",
                f": {s.error}" if s.error else "",
            )

    async def _server_info(self, s: NodeState) -> None:
        """Re-read every round: a restarted node may come back with another fingerprint."""
        assert s.stub is not None
        try:
            info = await s.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:  # optional for SGLang workers
                raise
            s.pairing_protocol, s.perf, s.local_prefill, s.local_decode = None, NodePerf(), False, False
            return
        args = json_format.MessageToDict(info.server_args)
        mode = args.get("disaggregation_mode")
        if mode is not None and mode != SERVER_MODE[s.role]:
            raise _Down(f"configured as {s.role} but serves disaggregation_mode={mode}")
        protocol = args.get("pairing_protocol")
        s.pairing_protocol = str(protocol) if protocol not in (None, "") else None
        s.perf, s.local_prefill = NodePerf.parse(args.get("perf")), args.get("local_prefill") is True
        s.local_decode = args.get("local_decode") is True
        page = args.get("page_size")  # a JSON number: a float once through the Struct
        s.page_size = int(page) if isinstance(page, (int, float)) and page > 0 else 0

    async def _loads(self, s: NodeState) -> None:
        assert s.stub is not None
        asked = time.monotonic()  # prompts sent while the report is on its way count as not in it
        try:
            resp = await s.stub.GetLoads(pb.GetLoadsRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return  # no load report: least-load then sees only our own in-flight count
        s.running = sum(x.num_running_reqs for x in resp.loads)
        s.waiting = sum(x.num_waiting_reqs for x in resp.loads)
        s.used_tokens = sum(x.num_used_tokens for x in resp.loads)
        s.waiting_prompt_tokens = sum(x.num_waiting_uncached_tokens for x in resp.loads)
        s.max_tokens = sum(x.max_total_num_tokens for x in resp.loads)
        latency_ms = max((x.disaggregation.kv_transfer_latency_ms for x in resp.loads), default=0.0)
        s.kv_transfer_s, s.loads_at = max(0.0, latency_ms) / 1000, asked


class _Down(Exception):
    """A node that answered but must not get traffic."""


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e) or type(e).__name__
