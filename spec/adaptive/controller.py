"""The adaptive-steps policy the EAGLE worker holds: batch size -> slot -> step count, fed by verifies."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any, Protocol, Sequence, runtime_checkable

from spec.adaptive.config import AdaptiveConfig
from spec.adaptive.slot import StepSlot


@runtime_checkable
class AdaptivePolicy(Protocol):
    """What the worker and scheduler call; a custom algorithm may inject its own implementation."""

    def steps_for_batch(self, batch_size: int) -> int:
        """The step count to run this decode iteration with (called at its top)."""
        ...

    def on_verify_complete(self, batch_size: int, accepted_drafts: Sequence[int]) -> bool:
        """Feedback of an iteration that ran with `batch_size`; True if a step count changed."""
        ...

    def on_shadow_acceptance(self, batch_size: int, first_draft_hits: Sequence[float]) -> None:
        """At steps 0: per request, the share of first drafts that would have been accepted (a
        draft catching up over tokens decoded without it)."""
        ...

    def candidate_steps(self) -> tuple[int, ...]:
        """Every step count that may be returned, sorted: each needs a runtime state."""
        ...

    def graph_batch_sizes_for_step(self, step: int) -> list[int]:
        """The graph batch sizes that may run `step`: capture only those."""
        ...

    def set_graph_batch_sizes(self, sizes: Sequence[int] | None) -> None:
        """The CUDA-graph batch sizes the worker captures (batch sizes are padded to them)."""
        ...

    def snapshot(self) -> list[dict[str, Any]]:
        """Per-slot state for metrics and the node log."""
        ...

    @property
    def total_switches(self) -> int: ...


class AdaptiveSteps:
    """One StepSlot per batch-size range of an AdaptiveConfig. Pure host logic: no GPU, no clock.

    The worker calls `steps_for_batch` at the top of every decode iteration and
    `on_verify_complete` on the CPU when that iteration's acceptance is known (one iteration late
    under the overlap scheduler). Both map the batch size the same way, so the feedback reaches the
    slot that chose the step count, even if another iteration was started in between.

    - A slot at steps 0 (plain decoding) has no verify, but must still be fed, one entry per
      request (zeros): its batches are what schedule the probe back up.
    - An iteration launched before a switch reports after it and is fed at the new step count.
      The minimum dwell leaves such a sample almost no weight by the slot's next decision.
    """

    def __init__(
        self, config: AdaptiveConfig, initial_steps: int, graph_batch_sizes: Sequence[int] | None = None
    ) -> None:
        config.check_initial_steps(initial_steps)
        self.config, self.initial_steps = config, initial_steps
        self._bounds = config.lower_bounds()
        # A slot that cannot run the initial steps starts at its nearest candidate.
        self._slots = tuple(StepSlot.from_config(config, slot, initial_steps) for _, slot in config.slots)
        self._graph_bs: tuple[int, ...] = ()
        self.set_graph_batch_sizes(graph_batch_sizes)
        self._active: int | None = None

    @property
    def slots(self) -> tuple[StepSlot, ...]:
        return self._slots

    @property
    def active_slot(self) -> int | None:
        """The index of the slot the last `steps_for_batch` used (None before the first call)."""
        return self._active

    @property
    def total_switches(self) -> int:
        return sum(slot.switches for slot in self._slots)

    def restarted(self) -> "AdaptiveSteps":
        """The same policy as at start-up (config, initial steps, graph sizes), its history gone."""
        return AdaptiveSteps(self.config, self.initial_steps, self._graph_bs or None)

    def set_graph_batch_sizes(self, sizes: Sequence[int] | None) -> None:
        sizes = list(sizes or ())
        if any(isinstance(bs, bool) or not isinstance(bs, int) or bs < 1 for bs in sizes):
            raise ValueError(f"graph batch sizes must be ints >= 1, got {sizes}")
        self._graph_bs = tuple(sorted(set(sizes)))

    def padded_batch_size(self, batch_size: int) -> int:
        """The graph batch size this batch runs at: the smallest >= it, or itself if none is."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch size must be an int >= 1, got {batch_size!r}")
        i = bisect_left(self._graph_bs, batch_size)
        return self._graph_bs[i] if i < len(self._graph_bs) else batch_size

    def slot_index_for(self, batch_size: int) -> int:
        # The slot is chosen by the padded size: that is the graph the iteration runs, and graphs
        # are captured per slot (graph_batch_sizes_for_step), so both sides must agree.
        padded = self.padded_batch_size(batch_size)
        return max(bisect_right(self._bounds, padded) - 1, 0)  # below every bound: the first slot

    def steps_for_batch(self, batch_size: int) -> int:
        self._active = self.slot_index_for(batch_size)
        return self._slots[self._active].current_steps

    def on_verify_complete(self, batch_size: int, accepted_drafts: Sequence[int]) -> bool:
        return self._slots[self.slot_index_for(batch_size)].update(accepted_drafts)

    def on_shadow_acceptance(self, batch_size: int, first_draft_hits: Sequence[float]) -> None:
        self._slots[self.slot_index_for(batch_size)].observe_shadow(first_draft_hits)

    def candidate_steps(self) -> tuple[int, ...]:
        return self.config.candidate_steps()

    def graph_batch_sizes_for_step(self, step: int) -> list[int]:
        return [bs for bs in self._graph_bs if step in self._slots[self.slot_index_for(bs)].cfg.candidate_steps]

    def snapshot(self) -> list[dict[str, Any]]:
        """Per slot: its batch-size range (of padded sizes; upper None = unbounded), steps, EMA,
        switches, batches seen, failed upshifts and shadow reports taken at steps 0."""
        uppers = [b - 1 for b in self._bounds[1:]] + [None]
        return [
            {
                "lower_bound": lo,
                "upper_bound": hi,
                "current_steps": slot.current_steps,
                "ema": slot.ema,
                "switches": slot.switches,
                "batches": slot.batches,
                "failed_upshifts": slot.failed_upshifts,
                "shadow_reports": slot.shadow_reports,
            }
            for lo, hi, slot in zip(self._bounds, uppers, self._slots)
        ]
