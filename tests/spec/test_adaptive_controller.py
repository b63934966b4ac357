"""Adaptive-steps controller: slot choice by batch size, graph pruning per step count, initial
steps per slot, feedback routing, the policy protocol and restarts."""

from __future__ import annotations

from typing import Any, Sequence

import pytest

from spec.adaptive import AdaptiveConfig, AdaptiveConfigError, AdaptivePolicy, AdaptiveSteps

GRAPHS = [1, 2, 4, 8, 16, 24, 32, 48, 64]


@pytest.mark.parametrize(
    "bs,with_graphs,without_graphs",
    [
        (1, 1, 1),
        (3, 4, 3),
        (5, 8, 5),
        (7, 8, 7),
        (8, 8, 8),
        (9, 16, 9),
        (30, 32, 30),
        (31, 32, 31),
        (33, 48, 33),
        (64, 64, 64),
        (100, 100, 100),
    ],
)
def test_padding_to_graph_batch_sizes(bs: int, with_graphs: int, without_graphs: int) -> None:
    assert AdaptiveSteps(AdaptiveConfig.default(), 3, GRAPHS).padded_batch_size(bs) == with_graphs
    assert AdaptiveSteps(AdaptiveConfig.default(), 3).padded_batch_size(bs) == without_graphs


@pytest.mark.parametrize(
    "bs,with_graphs,without_graphs",
    [
        (1, 1, 1),
        (4, 1, 1),
        (5, 8, 1),
        (7, 8, 1),
        (8, 8, 8),
        (24, 8, 8),
        (25, 32, 8),
        (30, 32, 8),
        (31, 32, 8),
        (32, 32, 32),
        (33, 32, 32),
        (49, 64, 32),
        (63, 64, 32),
        (64, 64, 64),
        (100, 64, 64),
    ],
)
def test_slot_choice_by_batch_size(bs: int, with_graphs: int, without_graphs: int) -> None:
    bound = dict(enumerate(AdaptiveConfig.default().lower_bounds()))
    policy = AdaptiveSteps(AdaptiveConfig.default(), 3, GRAPHS)
    assert bound[policy.slot_index_for(bs)] == with_graphs
    policy.set_graph_batch_sizes(None)
    assert bound[policy.slot_index_for(bs)] == without_graphs


def test_batch_below_every_lower_bound_uses_the_first_slot() -> None:
    cfg = AdaptiveConfig.from_json({"4": {"candidate_steps": [3]}, "16": {"candidate_steps": [1]}})
    policy = AdaptiveSteps(cfg, 3)
    assert [policy.slot_index_for(bs) for bs in (1, 3, 4, 15, 16, 1000)] == [0, 0, 0, 0, 1, 1]
    policy.set_graph_batch_sizes([2, 20])
    assert [policy.slot_index_for(bs) for bs in (1, 3, 21)] == [0, 1, 1]  # 1 -> 2, 3 -> 20, 21 -> 21


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_bad_batch_sizes_are_refused(bad: Any) -> None:
    policy = AdaptiveSteps(AdaptiveConfig.default(), 3, GRAPHS)
    with pytest.raises(ValueError, match="batch size"):
        policy.steps_for_batch(bad)
    with pytest.raises(ValueError, match="graph batch sizes"):
        policy.set_graph_batch_sizes([1, bad])


def test_graph_pruning_per_step_for_the_default_config() -> None:
    policy = AdaptiveSteps(AdaptiveConfig.default(), 3, GRAPHS)
    assert policy.candidate_steps() == (0, 1, 3, 5, 7)
    assert {s: policy.graph_batch_sizes_for_step(s) for s in policy.candidate_steps()} == {
        0: [1, 2, 4, 8, 16, 24, 32, 48, 64],
        1: [1, 2, 4, 8, 16, 24, 32, 48, 64],
        3: [1, 2, 4, 8, 16, 24, 32, 48, 64],
        5: [1, 2, 4, 8, 16, 24, 32, 48],
        7: [1, 2, 4, 8, 16, 24],
    }
    assert policy.graph_batch_sizes_for_step(2) == []
    # Every batch size can run its slot's current steps with a graph captured for it.
    for bs in range(1, 65):
        assert policy.padded_batch_size(bs) in policy.graph_batch_sizes_for_step(policy.steps_for_batch(bs))
    assert AdaptiveSteps(AdaptiveConfig.default(), 3).graph_batch_sizes_for_step(3) == []


@pytest.mark.parametrize(
    "initial,expected", [(3, [3, 3, 3, 3]), (7, [7, 7, 5, 3]), (5, [5, 5, 5, 3]), (0, [0, 0, 0, 0]), (1, [1, 1, 1, 1])]
)
def test_each_slot_starts_at_its_candidate_nearest_the_initial_steps(initial: int, expected: list[int]) -> None:
    policy = AdaptiveSteps(AdaptiveConfig.default(), initial)
    assert [s["current_steps"] for s in policy.snapshot()] == expected


def test_initial_steps_outside_every_slot_is_refused() -> None:
    with pytest.raises(AdaptiveConfigError, match=r"initial steps 4 .*\[0, 1, 3, 5, 7\]"):
        AdaptiveSteps(AdaptiveConfig.default(), 4)


def test_feedback_reaches_the_slot_the_batch_size_maps_to() -> None:
    policy = AdaptiveSteps(AdaptiveConfig.default(), 7, GRAPHS)
    assert policy.steps_for_batch(3) == 7 and policy.active_slot == 0
    assert policy.steps_for_batch(20) == 7 and policy.active_slot == 1
    switched = [policy.on_verify_complete(3, [0, 0, 0]) for _ in range(20)]  # bs 3 -> 4 -> slot "1"
    assert switched == [False] * 19 + [True]
    # no drafts accepted: down several levels at once, to 3 (to 1 and plain once the EMA <= 0.05)
    assert policy.steps_for_batch(2) == 3 and policy.steps_for_batch(20) == 7
    assert policy.total_switches == 1
    assert not policy.on_verify_complete(20, [])  # an empty batch feeds nothing
    snap = policy.snapshot()
    assert [(s["lower_bound"], s["upper_bound"]) for s in snap] == [(1, 7), (8, 31), (32, 63), (64, None)]
    assert snap[0] == {
        "lower_bound": 1,
        "upper_bound": 7,
        "current_steps": 3,
        "ema": pytest.approx(6 * 0.8**20),
        "switches": 1,
        "batches": 20,
        "failed_upshifts": 0,
        "shadow_reports": 0,
    }
    assert [s["batches"] for s in snap] == [20, 0, 0, 0]
    assert [s["ema"] for s in snap[1:]] == [6.0, 4.0, 2.0]


def test_policies_satisfy_the_protocol() -> None:
    assert isinstance(AdaptiveSteps(AdaptiveConfig.default(), 3), AdaptivePolicy)
    declared = {name for name in vars(AdaptivePolicy) if not name.startswith("_")}
    assert declared == {
        "steps_for_batch",
        "on_verify_complete",
        "on_shadow_acceptance",
        "candidate_steps",
        "graph_batch_sizes_for_step",
        "set_graph_batch_sizes",
        "snapshot",
        "total_switches",
    }

    class Fixed:  # a custom algorithm injecting its own policy
        total_switches = 0

        def steps_for_batch(self, batch_size: int) -> int:
            return 3

        def on_verify_complete(self, batch_size: int, accepted_drafts: Sequence[int]) -> bool:
            return False

        def on_shadow_acceptance(self, batch_size: int, first_draft_hits: Sequence[float]) -> None:
            pass

        def candidate_steps(self) -> tuple[int, ...]:
            return (3,)

        def graph_batch_sizes_for_step(self, step: int) -> list[int]:
            return []

        def set_graph_batch_sizes(self, sizes: Sequence[int] | None) -> None:
            pass

        def snapshot(self) -> list[dict[str, Any]]:
            return []

    assert isinstance(Fixed(), AdaptivePolicy)
    assert not isinstance(object(), AdaptivePolicy)


def test_restarted_policy_forgets_its_history() -> None:
    policy = AdaptiveSteps(AdaptiveConfig.default(), 7, GRAPHS)
    for _ in range(20):
        policy.on_verify_complete(3, [0, 0, 0])
    fresh = policy.restarted()
    assert fresh.snapshot() == AdaptiveSteps(AdaptiveConfig.default(), 7, GRAPHS).snapshot()
    assert fresh.graph_batch_sizes_for_step(7) == policy.graph_batch_sizes_for_step(7)
    assert policy.snapshot()[0]["current_steps"] == 3  # the original keeps its own
