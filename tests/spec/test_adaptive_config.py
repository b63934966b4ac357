"""Adaptive-steps config: the built-in default, the legacy form, merging, files, and every validation error."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from spec.adaptive import DEFAULT_ADAPTIVE_CONFIG, AdaptiveConfig, AdaptiveConfigError, SlotConfig


def _slots(cfg: AdaptiveConfig) -> dict[int, SlotConfig]:
    return dict(cfg.slots)


def test_default_config() -> None:
    before = copy.deepcopy(DEFAULT_ADAPTIVE_CONFIG)
    cfg = AdaptiveConfig.default()
    assert DEFAULT_ADAPTIVE_CONFIG == before  # parsing must not touch the module constant
    assert cfg == AdaptiveConfig.from_json(DEFAULT_ADAPTIVE_CONFIG)
    assert cfg.lower_bounds() == (1, 8, 32, 64)
    slots = _slots(cfg)
    both = {"up_hysteresis": -0.45, "down_hysteresis": -0.45}
    assert slots[1] == SlotConfig((0, 1, 3, 5, 7), **both)
    assert slots[8] == SlotConfig((0, 1, 3, 5, 7), **both)
    assert slots[32] == SlotConfig((0, 1, 3, 5), **both)
    assert slots[64] == SlotConfig((0, 1, 3), **both)
    assert all(s.ceiling_coeff == 0.0 for s in slots.values())
    assert (cfg.ema_alpha, cfg.warmup_batches, cfg.update_interval) == (0.2, 10, 5)
    assert (cfg.min_dwell, cfg.upshift_backoff, cfg.upshift_backoff_max) == (16, 64, 1024)
    assert cfg.confirm_decisions == 2
    assert cfg.candidate_steps() == (0, 1, 3, 5, 7)
    assert cfg.max_steps() == 7


def test_legacy_single_entry_form_is_one_slot_for_every_batch_size() -> None:
    cfg = AdaptiveConfig.from_json(
        {"candidate_steps": [7, 1, 3, 3], "ema_alpha": 0.3, "down_hysteresis": -0.5, "update_interval": 2}
    )
    assert cfg.slots == ((1, SlotConfig((1, 3, 7), down_hysteresis=-0.5)),)  # sorted, unique
    assert (cfg.ema_alpha, cfg.update_interval, cfg.warmup_batches) == (0.3, 2, 10)
    assert cfg.candidate_steps() == (1, 3, 7)


def test_top_level_settings_merge_into_slots_and_slots_override() -> None:
    cfg = AdaptiveConfig.from_json(
        {
            "ema_alpha": 0.5,
            "warmup_batches": 0,
            "update_interval": 1,
            "min_dwell": 4,
            "upshift_backoff": 8,
            "upshift_backoff_max": 8,
            "confirm_decisions": 1,
            "up_hysteresis": 0.2,
            "down_hysteresis": -0.5,
            "ceiling_coeff": 1.5,
            "32": {"candidate_steps": [0, 1]},  # keys in any order: slots come out sorted
            "1": {"candidate_steps": [1, 3], "down_hysteresis": -0.1, "ceiling_coeff": 0},
        }
    )
    assert cfg.lower_bounds() == (1, 32)
    slots = _slots(cfg)
    assert slots[1] == SlotConfig((1, 3), up_hysteresis=0.2, down_hysteresis=-0.1, ceiling_coeff=0.0)
    assert slots[32] == SlotConfig((0, 1), up_hysteresis=0.2, down_hysteresis=-0.5, ceiling_coeff=1.5)
    assert (cfg.ema_alpha, cfg.warmup_batches, cfg.update_interval) == (0.5, 0, 1)
    assert (cfg.min_dwell, cfg.upshift_backoff, cfg.upshift_backoff_max) == (4, 8, 8)
    assert cfg.confirm_decisions == 1


def test_slot_without_hysteresis_gets_the_slot_defaults() -> None:
    slot = _slots(AdaptiveConfig.from_json({"4": {"candidate_steps": [2]}}))[4]
    assert slot == SlotConfig((2,), up_hysteresis=0.0, down_hysteresis=-0.25, ceiling_coeff=0.0)


def test_python_int_keys_and_ints_for_floats_are_accepted() -> None:
    cfg = AdaptiveConfig.from_json({1: {"candidate_steps": (3, 1), "up_hysteresis": 1}, "ema_alpha": 1})
    assert cfg.slots == ((1, SlotConfig((1, 3), up_hysteresis=1.0)),)
    assert cfg.ema_alpha == 1.0 and isinstance(cfg.ema_alpha, float)


def test_file_path_and_json_text(tmp_path: Path) -> None:
    obj = {"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 1]}, "ema_alpha": 0.4}
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(obj), encoding="utf-8")
    expected = AdaptiveConfig.from_json(obj)
    assert AdaptiveConfig.from_json(path) == expected
    assert AdaptiveConfig.from_json(str(path)) == expected
    assert AdaptiveConfig.from_json("  " + json.dumps(obj)) == expected


def test_to_json_round_trip(tmp_path: Path) -> None:
    cfg = AdaptiveConfig.from_json({"candidate_steps": [1, 3, 7], "ema_alpha": 0.3, "ceiling_coeff": 2, "min_dwell": 0})
    for c in (cfg, AdaptiveConfig.default()):
        out = c.to_json()
        assert AdaptiveConfig.from_json(out) == c
        path = tmp_path / "resolved.json"
        path.write_text(json.dumps(out), encoding="utf-8")  # what the node logs is valid JSON
        assert AdaptiveConfig.from_json(path) == c
    out = cfg.to_json()
    assert out["1"] == {
        "candidate_steps": [1, 3, 7],
        "up_hysteresis": 0.0,
        "down_hysteresis": -0.25,
        "ceiling_coeff": 2.0,
    }
    assert {k: v for k, v in out.items() if k != "1"} == {
        "ema_alpha": 0.3,
        "warmup_batches": 10,
        "update_interval": 5,
        "min_dwell": 0,
        "upshift_backoff": 64,
        "upshift_backoff_max": 1024,
        "confirm_decisions": 2,
    }


def test_slot_config_normalizes_and_validates_when_built_directly() -> None:
    assert SlotConfig([5, 1, 5]).candidate_steps == (1, 5)  # type: ignore[arg-type]
    with pytest.raises(AdaptiveConfigError, match="SlotConfig: candidate_steps"):
        SlotConfig(())
    with pytest.raises(AdaptiveConfigError, match='slot "0"'):
        AdaptiveConfig(((0, SlotConfig((1,))),))
    with pytest.raises(AdaptiveConfigError, match='slot "8".*given once'):
        AdaptiveConfig(((8, SlotConfig((1,))), (8, SlotConfig((3,)))))
    with pytest.raises(AdaptiveConfigError, match="top level: slots must be"):
        AdaptiveConfig(())


def test_the_documented_message_for_an_empty_candidate_list() -> None:
    with pytest.raises(AdaptiveConfigError) as e:
        AdaptiveConfig.from_json({"1": {"candidate_steps": [1]}, "8": {"candidate_steps": []}})
    assert str(e.value) == ('adaptive config slot "8": candidate_steps must be a non-empty list of ints >= 0, got []')


GOOD = {"candidate_steps": [1, 3]}
LEGACY = "top level (legacy single-entry form)"


@pytest.mark.parametrize(
    "obj,where,what",
    [
        # candidate lists
        ({"8": {"candidate_steps": []}}, 'slot "8"', "candidate_steps"),
        ({"1": {"candidate_steps": [1, -1]}}, 'slot "1"', "candidate_steps"),
        ({"1": {"candidate_steps": [1, 2.0]}}, 'slot "1"', "candidate_steps"),
        ({"1": {"candidate_steps": [True, 3]}}, 'slot "1"', "candidate_steps"),
        ({"1": {"candidate_steps": ["3"]}}, 'slot "1"', "candidate_steps"),
        ({"1": {"candidate_steps": 3}}, 'slot "1"', "candidate_steps"),
        ({"1": {"candidate_steps": None}}, 'slot "1"', "candidate_steps"),
        ({"candidate_steps": [], "ema_alpha": 0.3}, LEGACY, "candidate_steps"),
        ({"candidate_steps": [-3]}, LEGACY, "candidate_steps"),
        ({"1": {"up_hysteresis": 0.1}}, 'slot "1"', "candidate_steps is required"),
        ({"1": [1, 3]}, 'slot "1"', "must be an object with candidate_steps"),
        # slot keys
        ({"ema_alpha": 0.3}, "top level", "no slot"),
        ({}, "top level", "no slot"),
        ({"0": GOOD}, 'slot "0"', "lower bound >= 1"),
        ({0: GOOD}, 'slot "0"', "lower bound >= 1"),
        ({"-1": GOOD}, 'slot "-1"', "lower bound >= 1"),
        ({"1": GOOD, "abc": GOOD}, "top level", 'unknown key "abc"'),
        ({"8": GOOD, "08": GOOD}, 'slot "08"', "lower bound 8 is given twice"),
        ({"1": GOOD, "speed": 2}, "top level", 'unknown key "speed"'),
        ({"1": {**GOOD, "foo": 1}}, 'slot "1"', 'unknown key "foo"'),
        ({"1": {**GOOD, "ema_alpha": 0.1}}, 'slot "1"', "ema_alpha is a top-level setting"),
        ({"1": GOOD, "candidate_steps": [1]}, "top level", "candidate_steps at the top level"),
        # shared settings
        ({"1": GOOD, "ema_alpha": 0}, "top level", "ema_alpha"),
        ({"1": GOOD, "ema_alpha": -0.1}, "top level", "ema_alpha"),
        ({"1": GOOD, "ema_alpha": 1.5}, "top level", "ema_alpha"),
        ({"1": GOOD, "ema_alpha": "0.2"}, "top level", "ema_alpha"),
        ({"1": GOOD, "ema_alpha": True}, "top level", "ema_alpha"),
        ({"1": GOOD, "ema_alpha": float("nan")}, "top level", "ema_alpha"),
        ({"1": GOOD, "warmup_batches": -1}, "top level", "warmup_batches"),
        ({"1": GOOD, "warmup_batches": 2.5}, "top level", "warmup_batches"),
        ({"1": GOOD, "warmup_batches": "10"}, "top level", "warmup_batches"),
        ({"1": GOOD, "warmup_batches": True}, "top level", "warmup_batches"),
        ({"1": GOOD, "update_interval": 0}, "top level", "update_interval"),
        ({"1": GOOD, "update_interval": -5}, "top level", "update_interval"),
        ({"1": GOOD, "update_interval": 1.0}, "top level", "update_interval"),
        ({"1": GOOD, "update_interval": None}, "top level", "update_interval"),
        ({"1": GOOD, "min_dwell": -1}, "top level", "min_dwell"),
        ({"1": GOOD, "min_dwell": "x"}, "top level", "min_dwell"),
        ({"1": GOOD, "upshift_backoff": -1}, "top level", "upshift_backoff"),
        ({"1": GOOD, "upshift_backoff": 64, "upshift_backoff_max": 32}, "top level", "upshift_backoff_max"),
        ({"1": GOOD, "upshift_backoff_max": 1.5}, "top level", "upshift_backoff_max"),
        ({"1": GOOD, "confirm_decisions": 0}, "top level", "confirm_decisions"),
        ({"1": GOOD, "confirm_decisions": 1.5}, "top level", "confirm_decisions"),
        ({"1": GOOD, "confirm_decisions": "2"}, "top level", "confirm_decisions"),
        # hysteresis and ceiling, per slot and as top-level defaults
        ({"1": {**GOOD, "up_hysteresis": "0.1"}}, 'slot "1"', "up_hysteresis"),
        ({"1": {**GOOD, "down_hysteresis": None}}, 'slot "1"', "down_hysteresis"),
        ({"1": {**GOOD, "ceiling_coeff": -1}}, 'slot "1"', "ceiling_coeff"),
        ({"1": {**GOOD, "ceiling_coeff": float("inf")}}, 'slot "1"', "ceiling_coeff"),
        ({"1": GOOD, "down_hysteresis": "x"}, "top level", "down_hysteresis"),
        ({"1": GOOD, "ceiling_coeff": -0.5}, "top level", "ceiling_coeff"),
        ({"1": {**GOOD, "down_hysteresis": 0.5}}, 'slot "1"', "down_hysteresis (0.5) must be <="),
        ({"1": GOOD, "up_hysteresis": -0.5}, 'slot "1"', "must be <= up_hysteresis (-0.5)"),
    ],
)
def test_validation_errors_name_the_key_and_the_field(obj: dict, where: str, what: str) -> None:
    with pytest.raises(AdaptiveConfigError) as e:
        AdaptiveConfig.from_json(obj)
    msg = str(e.value)
    assert msg.startswith(f"adaptive config {where}: "), msg
    assert what in msg, msg


def test_bad_json_text_and_non_objects(tmp_path: Path) -> None:
    with pytest.raises(AdaptiveConfigError, match="adaptive config text: not valid JSON"):
        AdaptiveConfig.from_json('{"1": {"candidate_steps": [1,]}}')
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(AdaptiveConfigError, match="top level: must be a JSON object, got list"):
        AdaptiveConfig.from_json(listing)


def test_missing_or_bad_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(AdaptiveConfigError, match=f"file {missing}: cannot read it"):
        AdaptiveConfig.from_json(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(AdaptiveConfigError, match=f"file {bad}: not valid JSON"):
        AdaptiveConfig.from_json(str(bad))
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"8": {"candidate_steps": [-1]}}', encoding="utf-8")
    with pytest.raises(AdaptiveConfigError) as e:
        AdaptiveConfig.from_json(wrong)
    assert 'slot "8": candidate_steps' in str(e.value) and str(wrong) in str(e.value)
    with pytest.raises(AdaptiveConfigError, match="expected a dict, JSON text or a path"):
        AdaptiveConfig.from_json(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", [4, 8, -1, True, 3.0])
def test_initial_steps_must_be_among_some_slots_candidates(steps: object) -> None:
    cfg = AdaptiveConfig.default()
    with pytest.raises(AdaptiveConfigError) as e:
        cfg.check_initial_steps(steps)  # type: ignore[arg-type]
    msg = str(e.value)
    assert f"initial steps {steps!r}" in msg and "candidate_steps [0, 1, 3, 5, 7]" in msg, msg


@pytest.mark.parametrize("steps", [0, 1, 3, 5, 7])
def test_initial_steps_in_the_union_are_accepted(steps: int) -> None:
    AdaptiveConfig.default().check_initial_steps(steps)
