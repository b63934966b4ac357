"""EAGLE's runtime states, one per draft step count: widths, graph batch sizes, and which one a batch runs.

Each candidate step count has its state built at start-up (its verify and draft-extend widths
from the algorithm's hook, and the batch sizes its graphs are captured for). At the top of every
decode iteration `activate_step_by_batch` picks the step count by batch size (adaptive steps,
spec/adaptive) and `fit` shrinks its state to the context room the batch has left, down to zero
drafts (a plain step that keeps the draft warm). The state travels with the batch (its
DecodePlan): switching is a reference swap, never a recapture; a state built for the context limit
alone runs eagerly where no graph was captured for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine.core import DecodePlan, ForwardMode
from spec.adaptive import AdaptiveSteps
from spec.config import MAX_WINDOW, SpecConfig, SpecConfigError


class WidthHooks(Protocol):
    """The algorithm's hooks that size a step (spec.registry.SpeculativeAlgorithm has them)."""

    @property
    def name(self) -> str: ...

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int: ...

    def supports_target_verify_for_draft(self) -> bool: ...


@dataclass(frozen=True)
class Widths:
    """Rows per request of the verify window and of the draft's fixed-width window."""

    verify: int
    draft: int
    draft_mode: ForwardMode  # DRAFT_EXTEND, or TARGET_VERIFY when the algorithm allows it
    drafts: int  # drafts along the longest path a verify can accept


@dataclass(frozen=True)
class StepState:
    steps: int  # draft tokens of a chain; levels of a tree; 0: verify the bonus alone
    widths: Widths
    topk: int
    graph_batch_sizes: tuple[int, ...] | None = None  # None: every captured size

    @property
    def is_chain(self) -> bool:
        return self.topk == 1 or self.steps == 0

    @property
    def window(self) -> int:
        """KV slots a decode step writes beyond seq_len: verify rows, draft scratch, draft-extend."""
        w = self.widths
        return max(w.verify, w.draft, 0 if self.is_chain else self.steps * self.topk)

    @property
    def draft_steps(self) -> int:
        """Drafting depth: a chain fills the verify window; a tree drafts its levels."""
        return self.widths.drafts if self.is_chain else self.steps

    def plan(self) -> DecodePlan:
        return DecodePlan(self.window, self.steps, self)


def resolve_widths(algorithm: WidthHooks, cfg: SpecConfig, steps: int) -> Widths:
    """Ask the algorithm for the widths of `steps` drafting steps; check the drafting can fill them."""
    k = cfg.eagle_topk
    if steps == 0 or k == 1:
        ntok = steps + 1
    else:
        ntok = min(cfg.ntok, 1 + k + (steps - 1) * k * k)
    w = algorithm.get_num_tokens_per_req_for_target_verify(ntok, False)
    wd = algorithm.get_num_tokens_per_req_for_target_verify(ntok, True)
    name = algorithm.name
    if not 1 <= w <= MAX_WINDOW or not 1 <= wd <= MAX_WINDOW:
        raise SpecConfigError(f"{name}: verify width {w} / draft width {wd} must be in [1, {MAX_WINDOW}]")
    if steps == 0 or k == 1:
        drafts = w - 1  # a chain drafts as many tokens as the window holds
    else:
        nodes = k + (steps - 1) * k * k
        if w - 1 > nodes:
            raise SpecConfigError(
                f"{name}: a verify window of {w} rows needs {w - 1} drafted nodes; "
                f"{steps} steps of top-{k} draft {nodes}"
            )
        drafts = min(steps, w - 1)
    if wd < drafts + 1:
        raise SpecConfigError(
            f"{name}: the draft-extend window ({wd} rows) must hold the longest accepted path ({drafts + 1} rows)"
        )
    mode = ForwardMode.TARGET_VERIFY if algorithm.supports_target_verify_for_draft() else ForwardMode.DRAFT_EXTEND
    return Widths(w, wd, mode, drafts)


class StepStates:
    """The states a worker may run, built at start-up, and the choice of one per decode batch."""

    def __init__(self, algorithm: WidthHooks, cfg: SpecConfig) -> None:
        self._algorithm, self._cfg = algorithm, cfg
        adaptive = cfg.adaptive_policy_config()
        self.policy = AdaptiveSteps(adaptive, cfg.num_steps) if adaptive is not None else None
        candidates = self.policy.candidate_steps() if self.policy is not None else (cfg.num_steps,)
        self.states: dict[int, StepState] = {s: self._build(s) for s in candidates}
        self.initial = self.states[cfg.num_steps]

    def _build(self, steps: int) -> StepState:
        return StepState(steps, resolve_widths(self._algorithm, self._cfg, steps), self._cfg.eagle_topk)

    def set_graph_batch_sizes(self, sizes: list[int] | None) -> None:
        """Graphs exist for these batch sizes: route slots by them and prune each state's own."""
        if self.policy is None:
            return
        self.policy.set_graph_batch_sizes(sizes)
        for steps, st in self.states.items():
            pruned = tuple(self.policy.graph_batch_sizes_for_step(steps)) if sizes else None
            self.states[steps] = StepState(st.steps, st.widths, st.topk, pruned)

    @property
    def max_window(self) -> int:
        return max(st.window for st in self.states.values())

    def activate_step_by_batch(self, batch_size: int) -> int:
        """The step count a decode batch of this size runs with: the adaptive choice for its size,
        else the configured steps (SGLang's name; called at the top of every decode iteration)."""
        return self.policy.steps_for_batch(batch_size) if self.policy is not None else self._cfg.num_steps

    def fit(self, steps: int, room: int) -> StepState:
        """The state of `steps`, shrunk until its window fits the context room left."""
        state = self.states.get(steps) or self._build(steps)
        while state.window > room and state.steps > 0:
            steps = state.steps - 1
            state = self.states.get(steps) or self._build(steps)
        return state

    def feedback(self, batch_size: int, accepted: list[int]) -> None:
        """Accepted drafts per request of a verify that ran at `batch_size` (one iteration late)."""
        if self.policy is not None:
            self.policy.on_verify_complete(batch_size, accepted)

    def shadow_feedback(self, batch_size: int, first_draft_hits: list[float]) -> None:
        """What a 0-step batch's drafts would have scored (spec/draft_catch_up.py)."""
        if self.policy is not None:
            self.policy.on_shadow_acceptance(batch_size, first_draft_hits)

    def snapshot(self) -> dict[str, Any] | None:
        if self.policy is None:
            return None
        return {"slots": self.policy.snapshot(), "switches": self.policy.total_switches}
