"""Adaptive speculative steps: the JSON config keyed by batch-size lower bounds, with clear errors."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NoReturn

# The built-in default, in the form a user writes. Set from the H100 and H200 sweeps of
# bench/gpu/spec_speedup.py (Llama-8B and -1B shapes, batch 1-64; bench/RESULTS.md): chains of
# 3-5 drafts pay when drafts are accepted, 7 only below batch 32, and from batch 64 on 5 loses
# to 3 on both shapes and both GPUs (3-8%: the 6-token verify window is no longer free).
# Hysteresis -0.45 both ways: a level is left upwards once its chain's last half-draft is mostly
# accepted (SGLang's 0 waits for a chain used up, which stays at 3 steps where 5 pays), and
# downwards (to plain decoding too) once the EMA is near zero. Plain decoding (0) is a candidate
# everywhere: traffic whose drafts are rarely accepted turns speculation off.
DEFAULT_ADAPTIVE_CONFIG: dict[str, Any] = {
    "up_hysteresis": -0.45,
    "down_hysteresis": -0.45,
    "1": {"candidate_steps": [0, 1, 3, 5, 7]},
    "8": {"candidate_steps": [0, 1, 3, 5, 7]},
    "32": {"candidate_steps": [0, 1, 3, 5]},
    "64": {"candidate_steps": [0, 1, 3]},
}
DEFAULT_EMA_ALPHA = 0.2
DEFAULT_WARMUP_BATCHES = 10
DEFAULT_UPDATE_INTERVAL = 5
DEFAULT_MIN_DWELL = 16  # iterations a switch persists before the next one (anti-flapping)
DEFAULT_UPSHIFT_BACKOFF = 64  # iterations upshifts from a level wait after a failed upshift
DEFAULT_UPSHIFT_BACKOFF_MAX = 1024  # the cap of that wait as it doubles
DEFAULT_CONFIRM_DECISIONS = 2  # consecutive decisions that must agree before a switch

SLOT_FIELDS = ("candidate_steps", "up_hysteresis", "down_hysteresis", "ceiling_coeff")
SETTINGS = (
    "ema_alpha",
    "warmup_batches",
    "update_interval",
    "min_dwell",
    "upshift_backoff",
    "upshift_backoff_max",
    "confirm_decisions",
)
_SLOT_DEFAULT_KEYS = SLOT_FIELDS[1:]  # top-level keys that are defaults for the slots
_INT_KEY = re.compile(r"[+-]?\d+")  # "-1" is a (bad) lower bound, not an unknown key


class AdaptiveConfigError(ValueError):
    """An adaptive-steps config that cannot work; the message names the key and the field."""


def _fail(where: str, msg: str) -> NoReturn:
    raise AdaptiveConfigError(f"adaptive config {where}: {msg}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python, not to us


def _is_number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _candidates(where: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value or not all(_is_int(s) and s >= 0 for s in value):
        _fail(where, f"candidate_steps must be a non-empty list of ints >= 0, got {value!r}")
    return tuple(sorted(set(value)))


def _number(where: str, name: str, value: object, lo: float | None = None) -> float:
    if not _is_number(value) or (lo is not None and value < lo):
        bound = "" if lo is None else f" >= {lo:g}"
        _fail(where, f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def _int(where: str, name: str, value: object, lo: int) -> None:
    if not _is_int(value) or value < lo:
        _fail(where, f"{name} must be an int >= {lo}, got {value!r}")


def _slot_fields(
    where: str, candidate_steps: object, up: object, down: object, ceiling: object
) -> tuple[tuple[int, ...], float, float, float]:
    """The four slot fields checked and normalized (candidates sorted and unique, numbers floats)."""
    cands = _candidates(where, candidate_steps)
    up_h = _number(where, "up_hysteresis", up)
    down_h = _number(where, "down_hysteresis", down)
    ceil_c = _number(where, "ceiling_coeff", ceiling, lo=0)
    # From steps a the upshift threshold is a - 0.5 + up; from the next candidate b the drop back
    # to a fires at ema <= a - 0.5 + down. With down > up, every EMA in between would switch
    # a -> b -> a on consecutive decisions.
    if down_h > up_h:
        _fail(
            where,
            f"down_hysteresis ({down_h:g}) must be <= up_hysteresis ({up_h:g}), or every "
            "EMA in between switches back and forth",
        )
    return cands, up_h, down_h, ceil_c


@dataclass(frozen=True)
class SlotConfig:
    """One batch-size range: the step counts it may choose among and its hysteresis."""

    candidate_steps: tuple[int, ...]  # sorted, unique, >= 0; 0 = plain decoding for this range
    up_hysteresis: float = 0.0  # added to the upshift threshold (> 0 makes climbing harder)
    down_hysteresis: float = -0.25  # added to the downshift threshold (< 0 makes dropping harder)
    ceiling_coeff: float = 0.0  # > 0: cap non-upshift targets at ceil(ema * coeff); 0 = off

    def __post_init__(self) -> None:
        fields = _slot_fields(
            "SlotConfig", self.candidate_steps, self.up_hysteresis, self.down_hysteresis, self.ceiling_coeff
        )
        for name, value in zip(SLOT_FIELDS, fields):
            object.__setattr__(self, name, value)  # frozen: normalize in place once

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate_steps": list(self.candidate_steps),
            "up_hysteresis": self.up_hysteresis,
            "down_hysteresis": self.down_hysteresis,
            "ceiling_coeff": self.ceiling_coeff,
        }


_SLOT_DEFAULTS = {name: getattr(SlotConfig, name) for name in _SLOT_DEFAULT_KEYS}


def _slot_from_json(where: str, raw: object, defaults: Mapping[str, Any]) -> SlotConfig:
    if not isinstance(raw, Mapping):
        _fail(where, f"must be an object with candidate_steps, got {raw!r}")
    for key in raw:
        if key in SETTINGS:
            _fail(where, f"{key} is a top-level setting (it applies to every slot); move it there")
        if key not in SLOT_FIELDS:
            _fail(where, f'unknown key "{key}" (known: {", ".join(SLOT_FIELDS)})')
    if "candidate_steps" not in raw:
        _fail(where, "candidate_steps is required (a non-empty list of ints >= 0)")
    merged = {**_SLOT_DEFAULTS, **defaults, **raw}  # the slot's own keys win over the top level
    return SlotConfig(*_slot_fields(where, *(merged[name] for name in SLOT_FIELDS)))


@dataclass(frozen=True)
class AdaptiveConfig:
    """Slots keyed by batch-size lower bound (sorted), plus the settings every slot shares.

    A slot covers the batch sizes from its lower bound up to the next slot's bound - 1; the last
    slot covers everything above. The batch size is the one padded to its CUDA-graph size.
    """

    slots: tuple[tuple[int, SlotConfig], ...]
    ema_alpha: float = DEFAULT_EMA_ALPHA  # weight of the newest batch in the EMA, in (0, 1]
    warmup_batches: int = DEFAULT_WARMUP_BATCHES  # batches a slot sees before its first decision
    update_interval: int = DEFAULT_UPDATE_INTERVAL  # then a decision every this many batches
    min_dwell: int = DEFAULT_MIN_DWELL  # a slot's batches after a switch with no further switch
    upshift_backoff: int = DEFAULT_UPSHIFT_BACKOFF  # 0 = no backoff after a failed upshift
    upshift_backoff_max: int = DEFAULT_UPSHIFT_BACKOFF_MAX
    confirm_decisions: int = DEFAULT_CONFIRM_DECISIONS  # 1 = switch on the first decision

    def __post_init__(self) -> None:
        where = "top level"
        alpha = self.ema_alpha
        if not _is_number(alpha) or not 0 < alpha <= 1:
            _fail(where, f"ema_alpha must be a number in (0, 1], got {alpha!r}")
        object.__setattr__(self, "ema_alpha", float(alpha))
        for name, lo in (
            ("warmup_batches", 0),
            ("update_interval", 1),
            ("min_dwell", 0),
            ("upshift_backoff", 0),
            ("confirm_decisions", 1),
        ):
            _int(where, name, getattr(self, name), lo)
        if not _is_int(self.upshift_backoff_max) or self.upshift_backoff_max < self.upshift_backoff:
            _fail(
                where,
                f"upshift_backoff_max must be an int >= upshift_backoff "
                f"({self.upshift_backoff}), got {self.upshift_backoff_max!r}",
            )
        object.__setattr__(self, "slots", _checked_slots(self.slots))

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | str | Path) -> AdaptiveConfig:
        """Parse a dict, JSON text (a str starting with "{") or a JSON file (a Path or other str)."""
        if isinstance(obj, Mapping):
            return _parse(cls, obj)
        raw, path = _load(obj)
        try:
            return _parse(cls, raw)
        except AdaptiveConfigError as e:
            if path is None:
                raise
            raise AdaptiveConfigError(f"{e} (in {path})") from None

    @classmethod
    def default(cls) -> AdaptiveConfig:
        return cls.from_json(DEFAULT_ADAPTIVE_CONFIG)

    def lower_bounds(self) -> tuple[int, ...]:
        return tuple(bound for bound, _ in self.slots)

    def candidate_steps(self) -> tuple[int, ...]:
        """Every step count some slot may choose, sorted: each needs a runtime state."""
        return tuple(sorted({s for _, slot in self.slots for s in slot.candidate_steps}))

    def max_steps(self) -> int:
        """The deepest chain any slot may run: it sizes buffers, verify width and KV reserve."""
        return self.candidate_steps()[-1]

    def check_initial_steps(self, steps: int) -> None:
        union = self.candidate_steps()
        if not _is_int(steps) or steps not in union:
            _fail(
                "top level",
                f"initial steps {steps!r} (--speculative-num-steps) are not among any "
                f"slot's candidate_steps {list(union)}",
            )

    def to_json(self) -> dict[str, Any]:
        """The resolved config (settings and every slot in full): what the node logs it runs."""
        out: dict[str, Any] = {name: getattr(self, name) for name in SETTINGS}
        out.update({str(bound): slot.to_json() for bound, slot in self.slots})
        return out


def _checked_slots(slots: object) -> tuple[tuple[int, SlotConfig], ...]:
    pairs = list(slots) if isinstance(slots, (list, tuple)) else []
    if not pairs or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], SlotConfig) for p in pairs):
        _fail("top level", f"slots must be a non-empty sequence of (lower bound, SlotConfig) pairs, got {slots!r}")
    seen: set[int] = set()
    for bound, _ in pairs:
        if not _is_int(bound) or bound < 1 or bound in seen:
            _fail(f'slot "{bound}"', "the key must be a batch-size lower bound >= 1, given once")
        seen.add(bound)
    return tuple(sorted(pairs, key=lambda p: p[0]))


def _load(obj: object) -> tuple[object, Path | None]:  # (decoded JSON, its file or None)
    if not isinstance(obj, (str, Path)):
        raise AdaptiveConfigError(f"adaptive config: expected a dict, JSON text or a path, got {type(obj).__name__}")
    path = None if isinstance(obj, str) and obj.lstrip().startswith("{") else Path(obj)
    where = "text" if path is None else f"file {path}"
    try:
        return json.loads(obj if path is None else path.read_text(encoding="utf-8")), path
    except (OSError, UnicodeDecodeError) as e:
        raise AdaptiveConfigError(f"adaptive config {where}: cannot read it: {e}") from None
    except json.JSONDecodeError as e:
        raise AdaptiveConfigError(f"adaptive config {where}: not valid JSON: {e}") from None


def _parse(cls: type[AdaptiveConfig], raw: object) -> AdaptiveConfig:
    if not isinstance(raw, Mapping):
        _fail("top level", f"must be a JSON object, got {type(raw).__name__}")
    slots: dict[int, tuple[str, object]] = {}  # lower bound -> (key as written, slot object)
    top: dict[str, Any] = {}
    for key, value in raw.items():
        if _is_int(key) or (isinstance(key, str) and _INT_KEY.fullmatch(key)):
            bound = int(key)
            if bound < 1:
                _fail(f'slot "{key}"', "the key must be a batch-size lower bound >= 1")
            if bound in slots:
                _fail(f'slot "{key}"', f'lower bound {bound} is given twice ("{slots[bound][0]}")')
            slots[bound] = (str(key), value)
        elif key in SETTINGS or key in SLOT_FIELDS:
            top[key] = value
        else:
            _fail(
                "top level",
                f'unknown key "{key}" (slots are integer-string batch-size lower '
                f"bounds >= 1; settings are {', '.join(SETTINGS + SLOT_FIELDS)})",
            )
    defaults = {k: top[k] for k in _SLOT_DEFAULT_KEYS if k in top}
    for name, value in defaults.items():  # blame the top level, not the first slot using it
        _number("top level", name, value, lo=0 if name == "ceiling_coeff" else None)
    if "candidate_steps" in top:  # the legacy single-entry form: one slot for every batch size
        if slots:
            keys = ", ".join(f'"{key}"' for key, _ in slots.values())
            _fail(
                "top level",
                "candidate_steps at the top level is the legacy single-entry form "
                f"and cannot be mixed with slot keys ({keys})",
            )
        slots[1] = ("1", {"candidate_steps": top["candidate_steps"]})
        where_of = {1: "top level (legacy single-entry form)"}
    else:
        where_of = {bound: f'slot "{key}"' for bound, (key, _) in slots.items()}
    if not slots:
        _fail(
            "top level",
            "no slot: give at least one integer-string key (a batch-size lower bound "
            'such as "1") with candidate_steps, or candidate_steps at the top level '
            "(the legacy single-entry form)",
        )
    parsed = tuple(
        (bound, _slot_from_json(where_of[bound], value, defaults)) for bound, (_, value) in sorted(slots.items())
    )
    return cls(parsed, **{k: top[k] for k in SETTINGS if k in top})
