"""PDDispatcher: the router's node side (router.contract.Dispatcher).

One job = one or more attempts (router/attempt.py). An attempt picks a (prefill, decode) pair, invents a random
positive int32 bootstrap room and sends the same GenerateRequest to both legs at once. The client
sees the decode stream; the prefill leg runs in the background and its failure ends the decode
leg. The prefill answers with the first token once its KV write to the decode completed: unless logprobs
are asked for (the prefill's answer carries none), that token goes to the client at once when the
decode has not sent it yet, and the decode's copy is skipped (router/relay.py). Before the first
event an attempt that fails is retried with backoff on a new pair (the failing node excluded) and
a new room; after it, a failure ends the job, so a decode that fails after the prefill's token
went out ends the job with an error. Closing the iterator sends Abort to both legs. With no PD
pair, a colocated node (if any) serves the job alone. Which node a failure is charged to is
router/blame.py's decision. The prefill path policy (router/prefill_path.py) may instead send the
prompt to the decode node alone (local: no bootstrap, the decode runs it between its decode steps);
each attempt, retries included, decides again. While `--pd-pooling` has the deployment pooled
(router/pooling.py, re-decided at each registry refresh and between them as requests come), a
request goes whole to one node instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from typing import AsyncGenerator

from prometheus_client import CollectorRegistry, Gauge

from common.defaults import check_pd_pooling
from common.sampling import SamplingParams
from common.stream_pacer import StreamPacer
from router.contract import (
    DispatchError,
    FinishEvent,
    GenerationJob,
    ModelCard,
    TokenEvent,
)
from router.blame import LegFailed
from router.kv_index import KvIndex
from router.metrics import CacheRouteMetrics, DispatchMetrics, PathMetrics
from router.nodes import NodeRegistry
from router.policy import Policy, pair_available
from router.pooling import DEFAULT_POOL_RULE, PoolMetrics, PoolRule, PoolSwitch, poolable, select_pooled
from router.path_rule import DEFAULT_RULE, PathRule
from router.prefill_path import PATHS, POLICIES, REASONS, Route, select_route
from router.sizing import TierBalance
from router.attempt import DEFAULT_STAGE_TIMEOUTS, AttemptContext, PDAttempt, StageTimeouts

log = logging.getLogger(__name__)


class PDDispatcher:
    def __init__(
        self,
        registry: NodeRegistry,
        prefill_policy: Policy,
        decode_policy: Policy,
        *,
        max_attempts: int = 3,
        timeouts: StageTimeouts = DEFAULT_STAGE_TIMEOUTS,
        backoff_s: float = 0.05,
        backoff_max_s: float = 1.0,
        ready_window_s: float = 60.0,
        probe_interval_s: float = 5.0,
        probe_input_ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
        auto_probe: bool = True,
        metrics_registry: CollectorRegistry | None = None,
        path_policy: str = "remote",
        kv_index: KvIndex | None = None,
        path_rule: PathRule = DEFAULT_RULE,
        pooling: str = "off",
        pool_rule: PoolRule = DEFAULT_POOL_RULE,
        stream_messages_per_s: float = 0.0,
    ) -> None:
        if path_policy not in POLICIES:
            raise ValueError(f"unknown prefill path policy {path_policy!r} (choose from {', '.join(POLICIES)})")
        check_pd_pooling(pooling, path_policy)
        self.registry, self.prefill_policy, self.decode_policy = registry, prefill_policy, decode_policy
        self.path_policy, self.path_rule = path_policy, path_rule
        self.max_attempts, self.timeouts = max(1, max_attempts), timeouts
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.ready_window_s, self.probe_interval_s, self.probe_input_ids = (
            ready_window_s,
            probe_interval_s,
            probe_input_ids,
        )
        # Its own registry unless given one: /metrics must expose it (or pass the HTTP side's registry).
        self.metrics_registry = metrics_registry if metrics_registry is not None else CollectorRegistry()
        self.metrics = DispatchMetrics(self.metrics_registry)
        # the router's message budget over every stream it relays (common/stream_pacer.py); 0: off
        stream = StreamPacer(messages_per_s=stream_messages_per_s) if stream_messages_per_s > 0 else None
        self._attempt_ctx = AttemptContext(timeouts, self.metrics, self.keep, stream)
        if stream is not None:
            export_stream_pacing(stream, self.metrics_registry)
        self.metrics.ready.set_function(lambda: float(self.ready()))
        self.path_metrics = PathMetrics(self.metrics_registry, REASONS, PATHS)
        self.balance = TierBalance(registry)
        self.path_metrics.bind(self.balance)
        self.pool = PoolSwitch(pooling, pool_rule)  # split or pooled (router/pooling.py)
        self.pool_metrics = PoolMetrics(self.metrics_registry)
        self.kv_index = kv_index  # the expected hit of each routed prompt, when nodes' caches are followed
        self.cache_metrics = CacheRouteMetrics(self.metrics_registry, kv_index) if kv_index is not None else None
        self._last_success: float | None = None
        self._last_probe = -float("inf")
        self._probe_task: asyncio.Task[bool] | None = None
        self._background: set[asyncio.Future] = set()
        if auto_probe:
            registry.listeners.append(self._on_refresh)
        registry.listeners.append(self.update_pool)

    def model(self) -> ModelCard | None:
        return self.registry.model_card()

    def ready(self) -> bool:
        """A handoff succeeded lately AND a healthy compatible pair (or colocated node) is there now:
        a recent success alone would keep a router with every decode dead "ready" for the window."""
        recent = self._last_success is not None and time.monotonic() - self._last_success <= self.ready_window_s
        return recent and self._placeable()

    def _placeable(self) -> bool:
        """Could a job be placed now, on any path the path policy takes?"""
        auto = self.path_policy == "auto"
        return pair_available(self.registry, local=self.path_policy != "remote", whole=auto)

    async def generate(self, job: GenerationJob) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        job_started = time.monotonic()
        blamed: set[str] = set()  # never again for this job
        tried: set[str] = set()  # avoided when another choice exists
        last: LegFailed | None = None
        for n in range(self.max_attempts):
            if last is not None:
                self.metrics.retries.labels(last.reason).inc()
                await asyncio.sleep(min(self.backoff_max_s, self.backoff_s * 2 ** (n - 1)) * random.uniform(0.5, 1.0))
            route = self._pick(job, blamed | tried) or self._pick(job, blamed)
            if route is None:
                if last is not None:
                    raise last.error
                raise DispatchError(
                    503,
                    "no healthy compatible prefill/decode pair (or colocated node) is available",
                    code="no_available_pair",
                    retry_after_s=1.0,
                )
            prefill, decode = route.prefill, route.decode
            self.metrics.pairs.labels(prefill.address if prefill else "-", decode.address).inc()
            cached = self._observe_route(route, job)
            rid = job.request_id if n == 0 else f"{job.request_id}-retry{n}"
            attempt = PDAttempt(self._attempt_ctx, job, prefill, decode, rid, route.estimate_s(), cached)
            events = attempt.events()
            started, reason = False, "client cancelled"
            output: list[int] = []  # what the streaming node will hold with the prompt
            try:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        if not started:
                            attempt.observe_first_token(job_started)
                            self._learn_rates(route)
                        self.balance.add_output(len(event.token_ids))
                        output += event.token_ids
                    started = True
                    if isinstance(event, FinishEvent) and event.finish_reason != "abort":
                        self._last_success = time.monotonic()  # before the yield: the consumer may stop here
                        self._learn_steps(route)
                        if self.kv_index is not None:  # a follow-up may come before the node's events
                            self.kv_index.expect(route.decode, job, output)
                    yield event
                return
            except LegFailed as f:
                attempt.blame, attempt.blame_reason = {node.address for node in f.blame}, f.reason
                reason = f"{f.reason}: {f.error.message}"
                if started:  # the client has part of the answer: no retry, and one line saying why
                    f.error.before_first_token = False
                    log.warning("request %s failed mid-stream on %s: %s", attempt.rid, attempt.nodes(), reason)
                    raise f.error from None
                if not f.retryable:
                    raise f.error from None
                log.warning(
                    "attempt %d/%d of %s failed before the first token: %s",
                    n + 1,
                    self.max_attempts,
                    job.request_id,
                    f.error,
                )
                blamed |= attempt.blame
                tried |= {node.address for node in (prefill, decode) if node is not None}
                last = f
            finally:
                await events.aclose()
                await attempt.close(reason)
        assert last is not None
        raise last.error

    def _learn_rates(self, route: Route) -> None:
        """A node that ran a prompt before the router saw its prompt rate measured reports it now,
        not at the next refresh: until then every route decision treats it as unmeasured."""
        if route.path != "colocated" and route.prompt_node.perf.prefill_tokens_per_s <= 0:
            self.registry.refresh_soon(route.prompt_node)

    def _learn_steps(self, route: Route) -> None:
        """Likewise a node that decoded before the router saw any of its decode steps measured:
        without them its local estimate is unknown and every prompt goes remote."""
        if route.path != "colocated" and not route.decode.perf.decode_step_s:
            self.registry.refresh_soon(route.decode)

    def _pick(self, job: GenerationJob, exclude: set[str]) -> Route | None:
        """A route (router/prefill_path.py) whose breaker slots are claimed here."""
        index = self.kv_index
        cached = (lambda node: index.expected_hit(node, job)) if index is not None else (lambda node: 0)
        if self.pool.due():
            self.update_pool()
        for _ in range(4):  # a half-open probe slot taken meanwhile: choose again
            pooled = (
                select_pooled(self.registry, self.decode_policy, job, exclude, cached) if self.pool.pooled else None
            )
            route = pooled or select_route(
                self.registry,
                self.prefill_policy,
                self.decode_policy,
                self.path_policy,
                job,
                exclude,
                cached,
                self.path_rule,
                self.balance.prefill_demand(),
            )
            if route is None:
                return None
            taken = []
            for node in (route.prefill, route.decode):
                if node is not None:
                    if not node.breaker.acquire():
                        break
                    taken.append(node)
            else:
                return route
            for node in taken:
                node.breaker.release()
        return None

    def _observe_route(self, route: Route, job: GenerationJob) -> int:
        """Records the route in the metrics and the tiers' demand; returns the prompt tokens its
        prompt node is expected to hold in its prefix cache."""
        prompt_tokens, hit = len(job.input_ids), 0
        if self.kv_index is not None and self.cache_metrics is not None:
            hit = self.kv_index.expected_hit(route.prompt_node, job)
            self.cache_metrics.expected_hit.observe(hit)
        d = route.decision
        self.path_metrics.observe(
            route.path,
            d.reason if d is not None else None,
            d.remote_s if d is not None else None,
            d.local_s if d is not None else None,
        )
        if route.path != "colocated":  # the tiers' demand: colocated nodes are in neither
            self.balance.add_prompt(prompt_tokens, hit, on_decode=route.path == "local")
        if log.isEnabledFor(logging.DEBUG):
            self._log_route(route, job)
        return hit

    def _log_route(self, route: Route, job: GenerationJob) -> None:
        """One line per request at debug: its path and why, and what each node of the route was
        expected to hold of its prompt (why a follow-up went where it did)."""
        held = {
            node.role: self.kv_index.expected_hit(node, job) if self.kv_index is not None else 0
            for node in (route.prefill, route.decode)
            if node is not None
        }
        d = route.decision

        def ms(s: float | None) -> str:
            return "-" if s is None else f"{s * 1e3:.1f}"

        log.debug(
            "route %s: path %s (%s), %d prompt tokens, expected held %s, estimates remote %s ms local %s ms",
            job.request_id,
            route.path,
            d.reason if d is not None else "-",
            len(job.input_ids),
            held,
            ms(d.remote_s if d is not None else None),
            ms(d.local_s if d is not None else None),
        )

    def update_pool(self) -> None:
        """Registry refresh hook: pool or split again from the tiers' recent load (router/pooling.py)."""
        load = self.balance.recent_load()
        switched = self.pool.update(load, poolable(self.registry))
        if switched:
            log.info(
                "PD deployment %s: tier load prefill %.2f, decode %.2f, pooled %.2f",
                "pooled (every node serves whole requests)" if self.pool.pooled else "split again",
                load.prefill,
                load.decode,
                load.pooled,
            )
        self.pool_metrics.record(self.pool.pooled, switched, load)

    async def probe(self) -> bool:
        """One tiny real request (one token) through a pair, so readiness needs no user traffic."""
        self._last_probe = time.monotonic()
        job = GenerationJob(
            f"probe-{uuid.uuid4().hex[:16]}", self.probe_input_ids, SamplingParams(max_new_tokens=1, temperature=0.0)
        )
        try:
            async with asyncio.timeout(self.timeouts.probe_timeout):
                async for _ in self.generate(job):
                    pass
        except (DispatchError, TimeoutError) as e:
            log.warning("readiness probe failed: %s", e or "timed out")
            return False
        return True

    def _on_refresh(self) -> None:
        """Registry refresh hook: publish node gauges; re-probe when no request succeeded lately."""
        self.metrics.sync_nodes(self.registry.states)
        now = time.monotonic()
        stale = self._last_success is None or now - self._last_success > self.ready_window_s / 2
        if (
            stale
            and (self._probe_task is None or self._probe_task.done())
            and now - self._last_probe >= self.probe_interval_s
            and self._placeable()
        ):
            self._probe_task = asyncio.create_task(self.probe(), name="readiness-probe")

    def keep(self, task: asyncio.Future) -> None:
        """Hold a reference to a background task until it ends (asyncio keeps only weak ones)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Stop background work (probe, leftover prefill legs and aborts) and the refresh hook."""
        for listener in (self._on_refresh, self.update_pool):
            if listener in self.registry.listeners:
                self.registry.listeners.remove(listener)
        pending = [t for t in [self._probe_task, *self._background] if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def export_stream_pacing(pacer: StreamPacer, registry: CollectorRegistry) -> None:
    """The router's stream pacing, read at each scrape (--stream-messages-per-s)."""
    Gauge(
        "pdserve_router_stream_interval_tokens",
        "Tokens a streamed message is asked to gather after its first, as of the last window "
        "(1: nodes pace themselves; more while the relay runs past --stream-messages-per-s)",
        registry=registry,
    ).set_function(lambda: float(pacer.interval))
    Gauge(
        "pdserve_router_relayed_tokens_per_second",
        "Tokens a second the router relayed to clients, over the stream pacer's last window",
        registry=registry,
    ).set_function(lambda: pacer.tokens_per_s)
