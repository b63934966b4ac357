"""Falling back to colocated execution while the decode tier is a PD deployment's bottleneck.

Pooled, every node serves whole requests as a colocated replica would (prefill nodes on the whole
path, decode nodes on the local path); the split returns once the decode tier has room again.

A 1P1D split caps decode at one GPU: under decode-heavy traffic its steps reach the TPOT guard
while the prefill GPU idles, and two colocated replicas, each stepping half the batch, serve more
(bench/RESULTS.md, goodput runs). Sending some requests whole to the prefill node while it still
computes every other prompt did not pay: its guard left its prompts too little time, and the
prompt queue grew to 0.6 s. Pooled, no node is a prefill tier for another: each computes only its
own requests' prompts, and decodes them.

The decision is per deployment, from the load over the last few seconds priced on the decode
nodes' measured step line (router/tier_load.py): the decode tier's step at the recent output rate
over its TPOT guard, the prefill tier's prompt tokens/s over its prompt rates, and every node's
step were all of them to take their share of both. Pool when the decode tier reaches
`enter_decode_load` of its budget, is busier than the prefill tier, and pooled steps would be at
least `min_gain` lighter than the split's busiest tier; split again when the decode tier's load
falls to `leave_decode_load`, prompts become the larger load, or pooling no longer lightens it. A
switch holds for at least `dwell_s`: it moves no request and no KV (requests in flight finish where
they are), so only flapping could cost. The thresholds come from the two-GPU goodput runs (bench/gpu/goodput.py
--deployments pd_pooled,colocated; PoolRule says why).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Collection

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.defaults import PD_POOLING_MODES
from router.contract import GenerationJob
from router.nodes import NodeRegistry, NodeState
from router.policy import Policy
from router.prefill_path import POOLED, PathDecision, Route, holds_local, holds_whole, runs_local_prompts
from router.tier_load import TierLoad

log = logging.getLogger(__name__)

MODES = PD_POOLING_MODES  # --pd-pooling
# Routing re-decides at most this often between refreshes: its own requests in flight show a rise
# in the decode tier's batch before the nodes' next load report does.
CHECK_INTERVAL_S = 0.25


@dataclass(frozen=True)
class PoolRule:
    """When `auto` pools and splits again (module docstring)."""

    # Pool only once the decode tier passes its TPOT budget (a load of 1): on two H100s, pooling from
    # 0.8 lost on both prefill_heavy and decode_heavy at their knees (bench/RESULTS.md, eighteenth
    # run): each pooled node's prompts then ride guarded decode steps, so the prefill GPU's prompt
    # rate fell from ~40K to 17K tokens/s and TPOT rose where the split still held it.
    enter_decode_load: float = 1.0
    leave_decode_load: float = 0.75
    min_gain: float = 0.05
    dwell_s: float = 3.0
    # A cold step line does not pool: one measured only below `trusted_batch` requests, priced past
    # `max_extrapolation` x its largest batch. After start-up the line may hold only warm-up batches
    # of a few requests, and on two H200s pooling engaged at or near a deployment's first points
    # only, once costing 19 points of attainment where the split met 100% (bench/RESULTS.md,
    # twenty-eighth goodput run). The decode node measures the batches it runs, so a real rise in
    # load soon prices on measure; a line measured on real batches is trusted past them (a decode
    # tier that cannot keep up at all prices an infinite batch, which is when pooling is wanted).
    max_extrapolation: float = 2.0
    trusted_batch: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.leave_decode_load < self.enter_decode_load or not 0 <= self.min_gain < 1 or self.dwell_s < 0:
            raise ValueError(f"need 0 < leave < enter decode load, min_gain in [0, 1) and dwell_s >= 0, got {self}")
        if self.max_extrapolation < 1:
            raise ValueError(f"need max_extrapolation >= 1, got {self.max_extrapolation}")

    def should_pool(self, load: TierLoad) -> bool:
        """From split: the decode tier past its TPOT budget by the recent output rate, busier than
        the prefill tier, and clearly heavier than the pooled steps. The batch it runs now does not
        decide: on two H100s a batch spike pooled chat_mix at a decode rate of 0.78, and the point
        that had held both SLOs split at 38.1 req/s fell to 76% of the loose one at 45.3
        (bench/RESULTS.md, nineteenth run); it also made loads pool that split again at once."""
        if math.isnan(load.decode) or math.isnan(load.prefill) or not math.isfinite(load.pooled):
            return False
        if self.extrapolated(load):
            return False
        busiest = max(load.decode, load.prefill)
        return (
            load.decode >= self.enter_decode_load
            and load.decode >= load.prefill
            and load.pooled <= busiest * (1 - self.min_gain)
        )

    def extrapolated(self, load: TierLoad) -> bool:
        """Is the split's decode load priced on a cold line, far past the batches it measured?"""
        line = load.line
        if line is None or line.largest_batch < 1 or line.largest_batch >= self.trusted_batch:
            return False
        return not math.isnan(load.split_batch) and load.split_batch > self.max_extrapolation * line.largest_batch

    def should_split(self, load: TierLoad) -> bool:
        """From pooled: the decode tier has room again, prompts are now the larger load, or pooling
        no longer lightens the busiest tier (by the rates alone: pooled, a decode node's own batch
        is only its share of the load)."""
        if math.isnan(load.decode) or math.isnan(load.prefill) or math.isnan(load.pooled):
            return False
        busiest = max(load.decode, load.prefill)
        return load.decode <= self.leave_decode_load or load.prefill > load.decode or load.pooled > busiest


DEFAULT_POOL_RULE = PoolRule()


class PoolSwitch:
    """The deployment's current mode (pooled or split) under --pd-pooling, updated from the tiers' load."""

    def __init__(self, mode: str, rule: PoolRule = DEFAULT_POOL_RULE, clock: Callable[[], float] = time.monotonic):
        if mode not in MODES:
            raise ValueError(f"unknown --pd-pooling {mode!r} (choose from {', '.join(MODES)})")
        self.mode, self.rule, self.clock = mode, rule, clock
        self.pooled = False
        self._since = -math.inf  # when the mode last changed
        self._checked = -math.inf  # when it was last re-decided

    def due(self) -> bool:
        """Is a re-decision due (CHECK_INTERVAL_S since the last one)? Never under off."""
        return self.mode != "off" and self.clock() - self._checked >= CHECK_INTERVAL_S

    def update(self, load: TierLoad, can_pool: bool) -> bool:
        """Re-decide from `load`; `can_pool`: some prefill node decodes and some decode node
        prefills (else the split stays). True when the mode changed."""
        now = self._checked = self.clock()
        want = self.pooled
        if not can_pool or self.mode == "off":
            want = False
        elif self.mode == "always":
            want = True
        elif now - self._since >= self.rule.dwell_s:
            want = not self.rule.should_split(load) if self.pooled else self.rule.should_pool(load)
        if want == self.pooled:
            return False
        self.pooled, self._since = want, now
        return True


def describe(load: TierLoad) -> str:
    """The loads and step line a switch was decided on, for its log line (what tuning the rule needs)."""
    loads = f"loads prefill {load.prefill:.2f} decode {load.decode:.2f} decode_local {load.decode_local:.2f} "
    loads += f"pooled {load.pooled:.2f} decode_batch {load.decode_batch:.2f}"
    line = load.line
    if line is None:
        return loads + ", no step line"
    return (
        f"{loads}, step line fixed {line.fixed_s * 1e3:.2f} ms per_request {line.per_request_s * 1e3:.3f} ms "
        f"cycle {line.cycle_s * 1e3:.1f} ms measured to batch {line.largest_batch}, split batch {load.split_batch:.0f}"
    )


def poolable(registry: NodeRegistry) -> bool:
    """Can the deployment pool: a healthy prefill node that decodes and a healthy decode node that prefills?"""
    return any(n.local_decode for n in registry.nodes("prefill")) and any(
        n.local_prefill for n in registry.nodes("decode")
    )


def _fits(node: NodeState, job: GenerationJob, cached: int) -> bool:
    """Can `node` hold the request's KV, prompt less its expected hit plus output, beside what it holds?"""
    prompt, max_new = max(1, len(job.input_ids) - cached), job.sampling.max_new_tokens
    if node.role == "decode":  # the local path's own checks: it runs prompts, with KV to spare
        return runs_local_prompts(node) and holds_local(node, prompt, max_new)
    return holds_whole(node, prompt, max_new)


def select_pooled(
    registry: NodeRegistry,
    policy: Policy,
    job: GenerationJob,
    exclude: Collection[str] = (),
    cached: Callable[[NodeState], int] = lambda node: 0,
) -> Route | None:
    """One node for the whole request among every node that can serve it alone, chosen as colocated
    nodes are (the decode policy): a prefill node runs it whole, a decode node locally. None when
    none can hold it (the caller routes it as split)."""
    nodes = [n for n in registry.nodes("prefill") if n.local_decode and n.usable() and n.address not in exclude]
    nodes += [n for n in registry.nodes("decode") if n.local_prefill and n.usable() and n.address not in exclude]
    while nodes:
        node = policy.choose(nodes, job)
        if _fits(node, job, cached(node)):
            path = "whole" if node.role == "prefill" else "local"
            return Route(None, node, path, PathDecision(path, None, None, POOLED))
        nodes.remove(node)
    return None


class PoolMetrics:
    """The mode, each switch, and the tiers' recent load the rule reads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        g = functools.partial(Gauge, registry=registry)
        self.pooled = g(
            "pdserve_router_pd_pooled",
            "1 while every PD node serves whole requests as a colocated replica (--pd-pooling), 0 while split",
        )
        self.switches = Counter(
            "pdserve_router_pd_pool_switches",
            "Changes of the deployment's mode, by the mode entered",
            ["to"],
            registry=registry,
        )
        for to in ("pooled", "split"):
            self.switches.labels(to)
        self.load = g(
            "pdserve_router_tier_load",
            "The recent load the pooling rule reads (router/tier_load.py): prefill (prompt tokens/s to compute "
            "over the prefill nodes' rates), decode (the decode nodes' step at the recent output rate over "
            "their TPOT guard's cycle), decode_batch (their step at the batch they run now, over it; shown, "
            "not decided on), pooled "
            "(every node's step at its share of prompts and output, over it), decode_local (decode with the "
            "prompts the decode nodes computed themselves inside their steps; shown, not decided on); "
            "NaN while unknown",
            ["tier"],
        )
        self.step_line = g(
            "pdserve_router_decode_step_line_seconds",
            "The decode step line the tier loads are priced on (router/tier_load.py): fixed (the step at "
            "batch 1), per_request, per_prompt_token (inside a step) and cycle (the step the TPOT guard "
            "allows); NaN while unknown",
            ["part"],
        )

    def record(self, pooled: bool, switched: bool, load: TierLoad) -> None:
        self.pooled.set(float(pooled))
        if switched:
            self.switches.labels("pooled" if pooled else "split").inc()
            log.info("pd pooling: %s on %s", "pooled" if pooled else "split", describe(load))
        values = (("prefill", load.prefill), ("decode", load.decode), ("decode_batch", load.decode_batch))
        for tier, value in (*values, ("pooled", load.pooled), ("decode_local", load.decode_local)):
            self.load.labels(tier).set(value)
        line = load.line
        parts = (line.fixed_s, line.per_request_s, line.per_prompt_token_s, line.cycle_s) if line else (math.nan,) * 4
        for part, seconds in zip(("fixed", "per_request", "per_prompt_token", "cycle"), parts):
            self.step_line.labels(part).set(seconds)
