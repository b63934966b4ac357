"""A PD deployment's load as split and as pooled, and the nodes that would carry it, from its step line.

A decode step costs a fixed part (reading the weights: the step at batch 1), a part per running
request, and, where prompt chunks ride inside it, a part per prompt token. A node that emits D
output tokens/s (a tokens per request per step) and computes P prompt tokens/s inside its steps
runs B = D x step / a requests, so its step is
    step = fixed / (1 - per_request x D / a - per_prompt_token x P)
(infinite once the denominator reaches 0: no batch keeps up). Split, the decode nodes share the
output and the prefill nodes the prompts; pooled, every node takes its share of both. The fixed
part is why two colocated replicas out-decode one decode node: each streams the weights for half
the batch. Each figure is a step over the guard's cycle (the TPOT guard per token a request
gains): at 1 the decode runs at its TPOT budget. The prefill tier's is its prompt tokens/s over
its measured prompt rates. A decode node keeps its step within the cycle up to
a x (1 - fixed / cycle) / per_request output tokens/s, which sizes the decode tier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from router.nodes import NodeState
from router.perf import NodePerf


@dataclass(frozen=True)
class StepLine:
    """A decode node's step in seconds: fixed + per_request x batch + per_prompt_token x tokens."""

    fixed_s: float
    per_request_s: float
    per_prompt_token_s: float
    tokens_per_step: float
    cycle_s: float  # the step its TPOT guard allows
    largest_batch: int = 0  # the largest batch measured: beyond it the line is extrapolated

    @staticmethod
    def of(perf: NodePerf) -> StepLine | None:
        """From a node's report: its step at batch 1 and at its largest measured batch, its prompt
        rate inside decode steps (or alone), its guard. None without a guard or a step line."""
        if perf.tpot_guard_s is None or not perf.decode_step_s:
            return None
        largest = perf.decode_step_s[-1][0]
        fixed = perf.step_s(1) or 0.0
        per_request = max(0.0, ((perf.step_s(largest) or fixed) - fixed) / (largest - 1)) if largest > 1 else 0.0
        rate = perf.mixed_tokens_per_s or perf.prefill_tokens_per_s
        per_step = perf.decode_tokens_per_step or 1.0
        cycle = perf.tpot_guard_s * per_step
        return StepLine(fixed, per_request, 1.0 / rate if rate > 0 else 0.0, per_step, cycle, largest)

    def tokens_within_guard(self) -> float:
        """Output tokens/s one node emits with its steps within the guard's cycle (NaN: how the
        step grows with the batch is unmeasured; 0: even one request passes the cycle)."""
        headroom = 1.0 - self.fixed_s / self.cycle_s if self.cycle_s > 0 else 0.0
        if headroom <= 0:
            return 0.0
        return self.tokens_per_step * headroom / self.per_request_s if self.per_request_s > 0 else math.nan

    def loaded_step_s(self, output_tokens_per_s: float, prompt_tokens_per_s: float = 0.0) -> float:
        """The step of a node emitting and computing these rates (inf: it cannot keep up)."""
        busy = self.per_request_s * output_tokens_per_s / self.tokens_per_step
        busy += self.per_prompt_token_s * prompt_tokens_per_s
        return self.fixed_s / (1.0 - busy) if busy < 1.0 else math.inf


@dataclass(frozen=True)
class TierLoad:
    """A deployment's load as fractions of what its nodes allow (NaN: unknown; inf: beyond reach)."""

    prefill: float  # split: prompt tokens/s to compute over the prefill nodes' prompt rates
    decode: float  # split: the decode nodes' step at the recent output rate, over their guard's cycle
    pooled: float  # pooled: every node's step at its share of prompts and output, over the cycle
    # the decode nodes' step at the batch they run now over the cycle: what the rates' window
    # takes its length to follow
    decode_batch: float = math.nan
    # `decode` with the prompts the decode nodes computed themselves (the local path) inside their
    # steps: shown, not decided on. The rule's `decode` leaves them out, and on two H200s it read
    # 0.33-0.63 while local prompts held the decode's TPOT p90 at 20-29 ms (bench/RESULTS.md,
    # twenty-seventh goodput run); this figure is what the next runs tune a rule that counts them on
    decode_local: float = math.nan
    line: StepLine | None = None  # the decode step line every figure above was priced on
    # the batch each decode node would run at the recent output rate, split (inf: none keeps up):
    # past the line's largest measured batch, `decode` is extrapolated
    split_batch: float = math.nan


def _line(decodes: Sequence[NodeState]) -> StepLine | None:
    """The line of the decode node that measured most batch sizes (nodes share model and GPUs)."""
    lines = [(len(n.perf.decode_step_s), line) for n in decodes if (line := StepLine.of(n.perf)) is not None]
    return max(lines, key=lambda x: x[0])[1] if lines else None


def tier_load(
    prefills: Sequence[NodeState],
    decodes: Sequence[NodeState],
    prompt_tokens_per_s: float,
    output_tokens_per_s: float,
    local_prompt_tokens_per_s: float = 0.0,
) -> TierLoad:
    """The load of `prompt_tokens_per_s` to compute and `output_tokens_per_s` to emit on these
    healthy nodes, split and pooled (pooled: prefill nodes decode on the decode nodes' line);
    `local_prompt_tokens_per_s`, of the prompts, those the decode nodes computed themselves."""
    prompt_rate = sum(n.perf.prefill_tokens_per_s for n in prefills)
    prefill = prompt_tokens_per_s / prompt_rate if prompt_rate > 0 else math.nan
    line = _line(decodes)
    if line is None or not decodes or line.cycle_s <= 0:
        return TierLoad(prefill, math.nan, math.nan)
    nodes = len(prefills) + len(decodes)
    per_decode = output_tokens_per_s / len(decodes)
    split_step = line.loaded_step_s(per_decode)
    local = line.loaded_step_s(per_decode, local_prompt_tokens_per_s / len(decodes)) / line.cycle_s
    pooled = line.loaded_step_s(output_tokens_per_s / nodes, prompt_tokens_per_s / nodes) / line.cycle_s
    batch = per_decode * split_step / line.tokens_per_step  # Little's law: requests = rate x step / tokens a step
    return TierLoad(prefill, split_step / line.cycle_s, pooled, _batch_load(decodes), local, line, batch)


def _batch_load(decodes: Sequence[NodeState]) -> float:
    """The busiest decode node's step at the batch it runs now, over its guard's cycle (NaN: unknown)."""
    loads = []
    for n in decodes:
        line, step = StepLine.of(n.perf), n.perf.step_s(max(n.running, n.inflight, 1))
        if line is not None and step and line.cycle_s > 0:
            loads.append(step / line.cycle_s)
    return max(loads, default=math.nan)


def nodes_needed(
    prefills: Sequence[NodeState], decodes: Sequence[NodeState], prompt_tokens_per_s: float, output_tokens_per_s: float
) -> tuple[float, float]:
    """(prefill, decode) nodes that would carry this load: the prompt rate over a prefill node's
    measured prompt rate, and the output rate over what a decode node emits with its steps within
    its TPOT guard, or, until its step is measured at two batch sizes, its reported capacity at
    --max-running (NaN: unmeasured; a decode node whose guard no step meets needs inf)."""
    rates = [n.perf.prefill_tokens_per_s for n in prefills if n.perf.prefill_tokens_per_s > 0]
    prefill = prompt_tokens_per_s / (sum(rates) / len(rates)) if rates else math.nan
    line = _line(decodes)
    per_node = line.tokens_within_guard() if line is not None else math.nan
    if math.isnan(per_node):  # growth with the batch unmeasured: the nodes' own figure at --max-running
        reported = [n.perf.decode_capacity_tokens_per_s for n in decodes if n.perf.decode_capacity_tokens_per_s > 0]
        per_node = sum(reported) / len(reported) if reported else math.nan
    if math.isnan(per_node):
        return prefill, math.nan
    if output_tokens_per_s <= 0:
        return prefill, 0.0
    return prefill, output_tokens_per_s / per_node if per_node > 0 else math.inf
