"""Speculative algorithms: built-ins, the plugin base class, registration and lookup.

Callers never branch on which algorithm runs; they ask it through the extension points below.
Plugins subclass `CustomSpecAlgo` and register by name, either with the `register` decorator or
through the entry-point group `pdserve.speculative` (the entry point names a class or a module
whose import registers it).
"""

from __future__ import annotations

import inspect
import warnings
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, ClassVar

if TYPE_CHECKING:
    from engine.core import Batch
    from engine.engine import EngineParts
    from engine.executor import Executor
    from spec.config import SpecConfig
    from spec.future_map import FutureMap

ENTRY_POINT_GROUP = "pdserve.speculative"


class SpecRegistryError(ValueError):
    """Bad registration or unknown algorithm; the message says what is wrong."""


class SpeculativeAlgorithm:
    """An algorithm and the questions the engine and nodes ask it. Defaults are EAGLE's."""

    name: ClassVar[str] = ""
    NONE: ClassVar["SpeculativeAlgorithm"]
    EAGLE: ClassVar["SpeculativeAlgorithm"]
    EAGLE3: ClassVar["SpeculativeAlgorithm"]

    # ---- extension points ----
    def is_speculative(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        """May the draft worker capture its graphs in TARGET_VERIFY mode (fixed-length windows)?"""
        return False

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int,
                                                 is_draft_worker: bool) -> int:
        """Tokens per request in a verify forward (fixes the verify CUDA-graph width)."""
        return num_draft_tokens

    def carries_draft_hidden_states(self) -> bool:
        """Does the PD handoff carry the draft's hidden state (sizes the aux row)?"""
        return True

    def needs_draft_model(self) -> bool:
        return True

    def create_future_map(self, num_rows: int, device: Any, *, debug: bool = False) -> "FutureMap":
        from spec.future_map import FutureMap

        return FutureMap(num_rows, device, need_topk=True, need_hidden=self.carries_draft_hidden_states(),
                         debug=debug)

    def build_disagg_draft_input(self, batch: "Batch", config: "SpecConfig", last_tokens: Any,
                                 future_map: "FutureMap | None") -> Any:
        """PD decode: turn a PREBUILT batch's handoff into this algorithm's draft input (or None)."""
        return None

    def create_worker(self, parts: "EngineParts", config: "SpecConfig") -> "Executor":
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"SpeculativeAlgorithm({self.name})"

    @staticmethod
    def from_name(name: str | None) -> "SpeculativeAlgorithm":
        """Case-insensitive lookup among built-ins and registered plugins."""
        key = (name or "NONE").upper()
        if key in _BUILTINS:
            return _BUILTINS[key]
        load_entry_points()
        try:
            return _PLUGINS[key]
        except KeyError:
            known = sorted(set(_BUILTINS) | set(_PLUGINS))
            raise SpecRegistryError(f"unknown speculative algorithm {name!r}; known: {', '.join(known)}") from None


class _NoSpec(SpeculativeAlgorithm):
    name = "NONE"

    def is_speculative(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def needs_draft_model(self) -> bool:
        return False

    def create_future_map(self, num_rows: int, device: Any, *, debug: bool = False) -> "FutureMap":
        from spec.future_map import FutureMap

        return FutureMap(num_rows, device, need_topk=False, need_hidden=False, debug=debug)

    def create_worker(self, parts: "EngineParts", config: "SpecConfig") -> "Executor":
        from engine.executor import PlainExecutor

        return PlainExecutor(parts.runner, parts.sampler)


class _Eagle(SpeculativeAlgorithm):
    name = "EAGLE"
    draft_format = "eagle"

    def build_disagg_draft_input(self, batch: "Batch", config: "SpecConfig", last_tokens: Any,
                                 future_map: "FutureMap | None") -> Any:
        from spec.eagle_disagg import build_eagle_disagg_draft_input

        return build_eagle_disagg_draft_input(batch, config, last_tokens, future_map)

    def create_worker(self, parts: "EngineParts", config: "SpecConfig") -> "Executor":
        from spec.eagle_worker import EagleWorker

        return EagleWorker.create(parts, config, self.draft_format, self)


class _Eagle3(_Eagle):
    name = "EAGLE3"
    draft_format = "eagle3"


_BUILTINS: dict[str, SpeculativeAlgorithm] = {a.name: a for a in (_NoSpec(), _Eagle(), _Eagle3())}
SpeculativeAlgorithm.NONE = _BUILTINS["NONE"]
SpeculativeAlgorithm.EAGLE = _BUILTINS["EAGLE"]
SpeculativeAlgorithm.EAGLE3 = _BUILTINS["EAGLE3"]
RESERVED_NAMES = frozenset(_BUILTINS) | {"NEXTN"}
_PLUGINS: dict[str, SpeculativeAlgorithm] = {}
_entry_points_loaded = False


class CustomSpecAlgo(SpeculativeAlgorithm):
    """Base class of plugin algorithms: override `create_worker` (required) and any other hook."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("create_worker",)


# every public method of the interface a plugin must end up with
INTERFACE = tuple(n for n, v in vars(SpeculativeAlgorithm).items()
                  if callable(v) and not n.startswith("_") and n != "from_name")


def _adopt_old_hook_names(cls: type) -> None:
    """Older plugins named the verify-width hook `..._per_bs_...`; forward the new name to it."""
    old = getattr(cls, "get_num_tokens_per_bs_for_target_verify", None)
    if old is None or "get_num_tokens_per_req_for_target_verify" in vars(cls):
        return

    def forward(self: Any, num_draft_tokens: int, is_draft_worker: bool) -> int:
        warnings.warn(f"{cls.__name__}.get_num_tokens_per_bs_for_target_verify is deprecated; "
                      "rename it get_num_tokens_per_req_for_target_verify", DeprecationWarning,
                      stacklevel=2)
        return old(self, num_draft_tokens, is_draft_worker)

    cls.get_num_tokens_per_req_for_target_verify = forward  # type: ignore[attr-defined]


def check_conforms(cls: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, CustomSpecAlgo)):
        raise SpecRegistryError(f"{cls!r} must be a subclass of CustomSpecAlgo")
    missing = [n for n in INTERFACE if not callable(getattr(cls, n, None))]
    not_overridden = [n for n in CustomSpecAlgo.REQUIRED
                      if getattr(cls, n) is getattr(SpeculativeAlgorithm, n)]
    if missing or not_overridden:
        raise SpecRegistryError(f"{cls.__name__} does not implement the speculative interface: "
                                f"missing {missing + not_overridden}")
    if inspect.isabstract(cls):
        raise SpecRegistryError(f"{cls.__name__} is abstract: {sorted(cls.__abstractmethods__)}")


def register(name: str) -> Callable[[type], type]:
    """Class decorator: `@register("MY_ALGO") class MyAlgo(CustomSpecAlgo): ...`."""

    def deco(cls: type) -> type:
        register_class(name, cls)
        return cls

    return deco


def register_class(name: str, cls: type) -> SpeculativeAlgorithm:
    key = name.upper()
    if not key or not key.replace("_", "").isalnum():
        raise SpecRegistryError(f"invalid algorithm name {name!r}: use letters, digits and '_'")
    if key in RESERVED_NAMES:
        raise SpecRegistryError(f"{name!r} is a reserved speculative algorithm name")
    if key in _PLUGINS:
        if type(_PLUGINS[key]) is cls:
            return _PLUGINS[key]  # re-importing the same plugin module is harmless
        raise SpecRegistryError(f"speculative algorithm {name!r} is already registered "
                                f"by {type(_PLUGINS[key]).__name__}")
    _adopt_old_hook_names(cls)
    check_conforms(cls)
    algo = cls()
    type(algo).name = key
    _PLUGINS[key] = algo
    return algo


def unregister(name: str) -> None:
    """For tests and hot reload: forget a plugin."""
    _PLUGINS.pop(name.upper(), None)


def load_entry_points() -> None:
    """Import every `pdserve.speculative` entry point once; a broken plugin names itself."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - surface any plugin import failure with its name
            raise SpecRegistryError(f"speculative plugin {ep.name!r} ({ep.value}) failed to load: {e}") from e
        if isinstance(obj, type) and ep.name.upper() not in _PLUGINS:
            register_class(ep.name, obj)


def registered_names() -> list[str]:
    load_entry_points()
    return sorted(set(_BUILTINS) | set(_PLUGINS))


def executor_factory(config: "SpecConfig") -> Callable[["EngineParts"], "Executor"]:
    """What `Engine(executor_factory=...)` takes: builds the algorithm's worker on the target."""
    cfg = config.resolved()
    algo = SpeculativeAlgorithm.from_name(cfg.algorithm)
    if algo.needs_draft_model() and not cfg.draft_model_path:
        raise SpecRegistryError(f"--speculative-algorithm {algo.name} needs --speculative-draft-model-path")
    return lambda parts: algo.create_worker(parts, cfg)


__all__ = ["CustomSpecAlgo", "SpeculativeAlgorithm", "SpecRegistryError", "executor_factory",
           "register", "registered_names"]
