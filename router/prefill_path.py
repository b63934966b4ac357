"""Where a request's prompt runs: on a prefill node (remote) or on its decode node (local), from
measured rates; or, when the decode tier is at its TPOT budget, the whole request on a prefill node
that decodes too (whole).

Pure functions over NodeState; no I/O (the clock aside, for calibrations). A decode node that
runs a prompt itself puts prompt chunks between its decode steps, keeping its running requests
within its TPOT guard T: a request gains a tokens per step, earning T * a - step(B) seconds per
step that chunks may spend, so prompts get (T * a - step(B)) / (T * a) of the node's time, and
each chunk pays the batch's fixed part (the node's measured prompt overhead) beside its tokens at
the node's rate; a node whose chunks ride inside its decode steps (`mixed_chunk`) pays no fixed
part, and its tokens go at its measured mixed rate once it has one.
Remote TTFT is the prefill's queue plus the prompt at its rate, each chunk with the prefill's
fixed part too, plus the KV transfer when the decode reports it. Each estimate is scaled by how
the node's earlier prompts on that path compared with their estimates (router/perf.py
TtftCalibration), so what the rates do not model is learnt.

Under `auto` the prefill tier is the default, because every prompt run locally slows the decode
node's running requests towards its guard: that is what disaggregation exists to avoid. A prompt
runs locally only when it is a follow-up turn whose history the decode holds and what it must
compute there is short (one chunk, cheaper than the transfer it saves) and its estimate there is
no worse than remote's or, where the decode holds more of the history than the prefill, within
the rule's history target and token limit (else the prefill recomputes what the decode holds);
or when the prefill tier is behind (its estimate over the rule's TTFT target) and local is
clearly faster (under the rule's margin of remote): overflow, so a saturated prefill tier no
longer caps the deployment. A decode node that mixes its chunks into its decode steps has a
target of 0 and no margin by default: there the faster path wins. An unmeasured prefill tier is
measured first (remote).

Whole: under `auto`, when one more request would put the decode node's measured step past its
TPOT guard, and the paired prefill node runs requests whole (`--local-decode-tpot-ms`) with its own
steps within its guard and KV to spare, the request runs there from prompt to last token: the
deployment falls back to colocated execution for the share of the load its split cannot carry.
With no usable decode node (and no colocated one), such a prefill node serves requests whole
rather than the router refusing them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

from common.defaults import DEFAULT_CHUNKED_PREFILL_SIZE, PD_PREFILL_POLICIES
from router.contract import GenerationJob
from router.nodes import NodeRegistry, NodeState
from router.path_rule import DEFAULT_RULE, PathRule
from router.perf import NodePerf
from router.policy import Policy, select_colocated, select_pair

POLICIES = PD_PREFILL_POLICIES
# The chunk a node runs a long prompt in (its chunked prefill size, by default): on a decode node
# its guard's chunks, on a prefill node its batches; each pays a prompt batch's fixed cost.
PROMPT_CHUNK_TOKENS = DEFAULT_CHUNKED_PREFILL_SIZE

# Why a path was taken: a fixed set, because each one is a metric label value.
POLICY = "policy"  # --pd-prefill-policy remote or local said so
FASTER_REMOTE = "faster_remote"
FASTER_LOCAL = "faster_local"
SHORT_LOCAL = "short_local"  # little to compute on the decode (a cached history, a short prompt)
HISTORY_LOCAL = "history_local"  # the decode holds more of the history, and is within the TTFT target
REMOTE_ON_TARGET = "remote_on_target"  # the prefill tier meets the TTFT target: no reason to slow decodes
REMOTE_UNMEASURED = "remote_unmeasured"  # the prefill has no measured rate yet: measure it first
LOCAL_UNMEASURED = "local_unmeasured"  # no rate (or no step time) to estimate the local path with
LOCAL_REFUSED = "local_refused"  # the decode runs no prompts itself (older node, or guard off)
DECODE_AT_BUDGET = "decode_at_budget"  # its decode steps alone fill the TPOT budget
KV_HEADROOM = "kv_headroom"  # the decode's free KV does not hold prompt + output
NO_PREFILL = "no_prefill"  # no usable prefill: local or nothing
NO_DECODE = "no_decode"  # no usable decode: whole on a prefill node that decodes, or nothing
DECODE_FULL = "decode_full"  # the decode's steps would pass its TPOT guard: whole on the prefill
POOLED = "pooled"  # every node serves whole requests (router/pooling.py): whole or local, by load
REASONS = (
    POLICY,
    FASTER_REMOTE,
    FASTER_LOCAL,
    SHORT_LOCAL,
    HISTORY_LOCAL,
    REMOTE_ON_TARGET,
    REMOTE_UNMEASURED,
    LOCAL_UNMEASURED,
    LOCAL_REFUSED,
    DECODE_AT_BUDGET,
    KV_HEADROOM,
    NO_PREFILL,
    NO_DECODE,
    DECODE_FULL,
    POOLED,
)
PATHS = ("remote", "local", "whole", "colocated")  # metric label values too


@dataclass(frozen=True)
class PathDecision:
    path: str | None  # "remote" | "local" | "whole"; None: neither can take the request
    remote_s: float | None  # estimated TTFT on the prefill (None: unknown or impossible)
    local_s: float | None  # estimated TTFT on the decode (None: unknown or impossible)
    reason: str  # one of REASONS


@dataclass(frozen=True)
class LocalEstimate:
    """The local path's TTFT (None: unknown) or why it cannot be taken (`refusal`, a reason)."""

    seconds: float | None = None
    refusal: str | None = None


def tier_rate(prefills: Sequence[NodeState]) -> float:
    """Mean measured prompt rate of the prefill tier (0: none measured). A decode that has run no
    prompt yet borrows it (same model, same GPUs); otherwise local would never be tried, so never measured."""
    rates = [p.perf.prefill_tokens_per_s for p in prefills if p.perf.prefill_tokens_per_s > 0]
    return sum(rates) / len(rates) if rates else 0.0


def remote_ttft(prefill: NodeState, prompt_tokens: int, now: float | None = None) -> float | None:
    """The prompt's wait and compute on `prefill`, each chunk with a prompt batch's fixed cost as
    on the local path, plus what its handoffs add (the prefill's reported KV transfer latency:
    last chunk computed -> final write done), scaled by how its earlier prompts compared with
    their estimates (None: rate unmeasured)."""
    perf = prefill.perf
    if perf.prefill_tokens_per_s <= 0:
        return None
    queued = prefill.waiting_prompt_tokens + prefill.prompts.since(prefill.loads_at) + prompt_tokens
    compute = queued / perf.prefill_tokens_per_s + math.ceil(queued / PROMPT_CHUNK_TOKENS) * perf.prompt_overhead_s
    return (compute + prefill.kv_transfer_s) * prefill.ttft.current(time.monotonic() if now is None else now)


def guard_cycle(guard: float, line: NodePerf) -> float:
    """Seconds a decode step may take under a TPOT guard: the guard per token a request gains per step."""
    return guard * max(1.0, line.decode_tokens_per_step)


def runs_local_prompts(decode: NodeState) -> bool:
    """Does `decode` run prompts sent to it without a prefill, under a TPOT guard?"""
    return decode.local_prefill and decode.perf.tpot_guard_s is not None


def holds_local(decode: NodeState, prompt_tokens: int, max_new_tokens: int) -> bool:
    """Does `decode` have KV for the prompt and output beside what it holds? Prompts queued there
    hold no KV yet, ours included; 0 capacity means the node never said (no)."""
    free = decode.max_tokens - decode.used_tokens - decode.prompts.total()
    return free >= prompt_tokens + max(0, max_new_tokens)


def local_ttft(
    decode: NodeState, prompt_tokens: int, max_new_tokens: int, borrowed_rate: float, now: float | None = None
) -> LocalEstimate:
    """The prompt run on `decode` between its decode steps, scaled by how its earlier local prompts
    compared with their estimates; `borrowed_rate` stands in for an unmeasured node's rate."""
    perf = decode.perf
    guard = perf.tpot_guard_s
    if not runs_local_prompts(decode) or guard is None:
        return LocalEstimate(refusal=LOCAL_REFUSED)
    if not holds_local(decode, prompt_tokens, max_new_tokens):
        return LocalEstimate(refusal=KV_HEADROOM)
    rate = perf.prefill_tokens_per_s or borrowed_rate
    # a node that runs its chunks inside its decode steps pays no fixed part per chunk
    overhead = 0.0 if perf.mixed_chunk else perf.prompt_overhead_s
    if perf.mixed_chunk and perf.mixed_tokens_per_s > 0:
        rate = perf.mixed_tokens_per_s
    # Other routers' requests show in the report, ours sent since the report in our count.
    batch = max(decode.running, decode.inflight)
    share, in_flight = 1.0, 0.0  # of the node's time that prompts may take; the step it waits for
    if batch > 0:
        step = perf.step_s(batch)
        if step is None:
            return LocalEstimate()
        cycle = guard_cycle(guard, perf)
        if cycle <= step:
            return LocalEstimate(refusal=DECODE_AT_BUDGET)
        share, in_flight = (cycle - step) / cycle, step
    if rate <= 0:
        return LocalEstimate()
    queued = decode.waiting_prompt_tokens + decode.prompts.since(decode.loads_at) + prompt_tokens
    # each chunk (the guard runs them up to a chunk's size) also pays the batch's fixed part
    chunks = math.ceil(queued / PROMPT_CHUNK_TOKENS)
    # A decoding node's first chunk starts after the step in flight: a fixed part that dominates
    # a short prompt's (a cached turn's) time. Left out, the calibration learned it as a ratio
    # (1.6 after cached turns) and then scaled every long prompt's estimate by it.
    raw = in_flight + (queued / rate + chunks * overhead) / share
    return LocalEstimate(seconds=raw * decode.ttft.current(time.monotonic() if now is None else now))


def steps_past_guard(node: NodeState, line: NodePerf) -> bool:
    """Would one more request put `node`'s decode steps, priced on `line`'s step times, past its TPOT
    guard (per token a request gains per step)? False when either is unknown."""
    guard, step = node.perf.tpot_guard_s, line.step_s(max(node.running, node.inflight) + 1)
    if guard is None or step is None:
        return False
    return step >= guard_cycle(guard, line)


def prompts_fit_beside_decoding(prefill: NodeState, line: NodePerf, prompt_demand: float) -> bool:
    """Would `prefill`, decoding one more request, still compute the prompt tokens/s it is asked for?
    Once it decodes, each of its steps is held to its TPOT guard, so its prompts get only what the
    decode step leaves of the guard. Unknown rates or demand: yes (the guard still holds its TPOT)."""
    guard, step = prefill.perf.tpot_guard_s, line.step_s(max(prefill.running, prefill.inflight) + 1)
    rate = prefill.perf.mixed_tokens_per_s or prefill.perf.prefill_tokens_per_s
    if guard is None or step is None or not rate or prompt_demand <= 0:
        return True
    cycle = guard_cycle(guard, line)
    return prompt_demand <= rate * max(0.0, cycle - step) / cycle


def holds_whole(prefill: NodeState, prompt_tokens: int, max_new_tokens: int) -> bool:
    """Does `prefill` have the KV for a whole request beside what it holds and is sent (0
    capacity: it never said)?"""
    free = prefill.max_tokens - prefill.used_tokens - prefill.prompts.total()
    return not prefill.max_tokens or free >= prompt_tokens + max(0, max_new_tokens)


def runs_whole(
    prefill: NodeState, decode: NodeState, prompt_tokens: int, max_new_tokens: int, prompt_demand: float = 0.0
) -> bool:
    """Should the request run whole on `prefill`: `decode` at its TPOT budget, and `prefill` one that
    decodes requests itself, within its own guard (on the decode's step times until it has measured
    its own: same model, same GPUs), with KV for the whole request, and with the prompt time its
    guard leaves it still enough for `prompt_demand` (prompt tokens/s asked of each prefill node)?
    Without that last check a prefill tier near its prompt capacity took whole requests past the
    decode's knee and its prompt queue grew to 0.6 s (two H100s, 1,024-token prompts at 32 req/s)."""
    if not prefill.local_decode or not steps_past_guard(decode, decode.perf):
        return False
    if not holds_whole(prefill, prompt_tokens, max_new_tokens):
        return False
    line = prefill.perf if prefill.perf.decode_step_s else decode.perf
    return not steps_past_guard(prefill, line) and prompts_fit_beside_decoding(prefill, line, prompt_demand)


def decide(
    policy: str,
    prefill: NodeState | None,
    decode: NodeState,
    prompt_tokens: int,
    max_new_tokens: int,
    prefill_tier: Sequence[NodeState] = (),
    cached: Callable[[NodeState], int] = lambda node: 0,
    rule: PathRule = DEFAULT_RULE,
) -> PathDecision:
    """Remote (on `prefill`) or local (on `decode`) for one request; path None when neither can take
    it (the caller falls back to a colocated node). `prefill` is the one the prefill policy picked,
    None when no usable prefill pairs with `decode`; `prefill_tier` the healthy prefills whose rates
    an unmeasured decode borrows; `cached(node)` the prompt tokens a node is expected to hold in its
    prefix cache (router/kv_index.py), which it does not compute: a follow-up turn goes where its
    history is. With no prefill, local is taken when only its rates are unknown; `rule`: see PathRule."""
    if policy == "remote":
        return PathDecision("remote" if prefill is not None else None, None, None, POLICY if prefill else NO_PREFILL)
    # at least its last token is always computed; a page of the hit may be EAGLE's to recompute
    held = cached(decode)  # looked up once: it walks the router's index of the node's pages
    local_tokens = max(1, prompt_tokens - held)
    local = local_ttft(decode, local_tokens, max_new_tokens, tier_rate(prefill_tier))
    if policy == "local":
        # The operator asked for it: the node's own admission and guard are the only limits.
        if local.refusal == LOCAL_REFUSED:
            return PathDecision(None, None, None, LOCAL_REFUSED)
        return PathDecision("local", None, local.seconds, POLICY)
    if prefill is None:
        return PathDecision(None if local.refusal else "local", None, local.seconds, local.refusal or NO_PREFILL)
    held_remote = cached(prefill)
    remote = remote_ttft(prefill, max(1, prompt_tokens - held_remote))
    if local.refusal is not None:
        return PathDecision("remote", remote, None, local.refusal)
    # a follow-up whose history the decode holds, short to finish there, and not slower there by
    # the measured rates (a busy decode node may be far slower at prompts than the prefill tier);
    # an uncached prompt goes to the prefill tier however short: each local one costs the decode a
    # whole forward beside its decode steps (GPU bench: 21-32 ms)
    short = local_tokens <= rule.local_max_tokens and held > 0
    if short and (remote is None or local.seconds is None or local.seconds <= remote):
        return PathDecision("local", remote, local.seconds, SHORT_LOCAL)
    kept = held - held_remote >= max(1, rule.history_min_tokens)
    within = held > 0 and local_tokens <= max(rule.local_max_tokens, rule.history_max_tokens)
    if within and kept and local.seconds is not None and local.seconds <= rule.history_target_s:
        return PathDecision("local", remote, local.seconds, HISTORY_LOCAL)
    if remote is None:  # cold start: measure the prefill tier first
        return PathDecision("remote", None, local.seconds, REMOTE_UNMEASURED)
    target, margin = rule.overflow(decode.perf.mixed_chunk)
    if remote <= target:
        return PathDecision("remote", remote, local.seconds, REMOTE_ON_TARGET)
    if local.seconds is None:
        return PathDecision("remote", remote, None, LOCAL_UNMEASURED)
    if local.seconds < remote * margin:
        return PathDecision("local", remote, local.seconds, FASTER_LOCAL)
    return PathDecision("remote", remote, local.seconds, FASTER_REMOTE)


@dataclass(frozen=True)
class Route:
    """Where one attempt goes: a pair (remote), a decode alone (local), a prefill alone (whole) or a
    colocated node."""

    prefill: NodeState | None
    decode: NodeState  # the node the request streams from: on the whole path, a prefill node
    path: str  # one of PATHS
    decision: PathDecision | None = None  # None: no choice of path was made (colocated)

    @property
    def prompt_node(self) -> NodeState:
        """The node that runs the prompt: the prefill on the remote path, else the node streaming."""
        return self.prefill if self.prefill is not None else self.decode

    def estimate_s(self) -> float | None:
        """The TTFT estimate of the path taken (None: colocated, or not estimated)."""
        if self.decision is None:
            return None
        return self.decision.local_s if self.path == "local" else self.decision.remote_s


def select_route(
    registry: NodeRegistry,
    prefill_policy: Policy,
    decode_policy: Policy,
    path_policy: str,
    job: GenerationJob,
    exclude: Collection[str] = (),
    cached: Callable[[NodeState], int] = lambda node: 0,
    rule: PathRule = DEFAULT_RULE,
    prompt_demand: float = 0.0,
) -> Route | None:
    """The pair the policies pick and, unless the path policy is remote, the path `decide` picks on
    it; with no pair (or path policy local), a decode that runs prompts itself, chosen by the decode
    policy; then a colocated node; under auto, then a prefill node that decodes, whole; None when
    nothing can take the job. `prompt_demand`: the prompt
    tokens/s the prefill tier is asked for (router/sizing.py), which a whole request must leave room for."""
    prompt, max_new = len(job.input_ids), job.sampling.max_new_tokens
    tier = registry.nodes("prefill")
    if path_policy != "local" and (pair := select_pair(registry, prefill_policy, decode_policy, job, exclude)):
        prefill, decode = pair
        d = decide(path_policy, prefill, decode, prompt, max_new, tier, cached, rule)
        per_prefill = prompt_demand / max(1, sum(n.usable() for n in tier))
        if path_policy == "auto" and runs_whole(prefill, decode, prompt, max_new, per_prefill):
            return Route(None, prefill, "whole", PathDecision("whole", d.remote_s, d.local_s, DECODE_FULL))
        return Route(prefill if d.path == "remote" else None, decode, d.path or "remote", d)
    if path_policy != "remote":
        locals_ = [n for n in registry.nodes("decode") if n.usable() and n.local_prefill and n.address not in exclude]
        while locals_:  # the decode policy's choice first; one without KV headroom passes to the next
            decode = decode_policy.choose(locals_, job)
            d = decide(path_policy, None, decode, prompt, max_new, tier, cached, rule)
            if d.path == "local":
                return Route(None, decode, "local", d)
            locals_.remove(decode)
        if path_policy == "local" and (pair := select_pair(registry, prefill_policy, decode_policy, job, exclude)):
            # no decode runs prompts itself: today's pairs rather than no answer
            return Route(*pair, "remote", PathDecision("remote", None, None, LOCAL_REFUSED))
    node = select_colocated(registry, decode_policy, job, exclude)
    if node is not None:
        return Route(None, node, "colocated")
    if path_policy == "auto":  # no decode and no colocated node: a prefill node that decodes serves it whole
        wholes = [n for n in tier if n.local_decode and n.usable() and n.address not in exclude]
        while wholes:
            node = decode_policy.choose(wholes, job)
            if holds_whole(node, prompt, max_new):
                return Route(None, node, "whole", PathDecision("whole", None, None, NO_DECODE))
            wholes.remove(node)
    return None
