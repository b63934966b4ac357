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

from engine.algorithm import EngineParts, PlainDecoding

if TYPE_CHECKING:
    from engine.core import Batch
    from engine.executor import Executor
    from engine.future_map import FutureMap
    from spec.config import SpecConfig

ENTRY_POINT_GROUP = "pdserve.speculative"


class SpecRegistryError(ValueError):
    """Bad registration or unknown algorithm; the message says what is wrong."""


class SpeculativeAlgorithm:
    """An algorithm and the questions the engine and nodes ask it. Defaults are EAGLE's."""

    name: ClassVar[str] = ""
    NONE: ClassVar["SpeculativeAlgorithm"]
    EAGLE: ClassVar["SpeculativeAlgorithm"]
    EAGLE3: ClassVar["SpeculativeAlgorithm"]

    # ---- identity: callers ask, they never compare names ----
    def is_none(self) -> bool:
        return not self.is_speculative()

    def is_some(self) -> bool:
        return self.is_speculative()

    def is_speculative(self) -> bool:
        return True

    def is_eagle(self) -> bool:
        """The EAGLE family (EAGLE-1/2 and EAGLE-3 heads)."""
        return False

    def is_eagle3(self) -> bool:
        return False

    def is_standalone(self) -> bool:
        """Drafts from a separate small language model."""
        return False

    def is_ngram(self) -> bool:
        """Drafts looked up in the request's own tokens, no draft model."""
        return False

    def is_dflash(self) -> bool:
        """Block drafting: the draft proposes a whole window in one forward."""
        return False

    # ---- extension points ----
    def supports_target_verify_for_draft(self) -> bool:
        """May the draft worker run (and capture its graphs) in TARGET_VERIFY mode, i.e. as
        fixed-width windows over the committed prefix? Asked otherwise, its runner refuses."""
        return False

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        """Tokens per request in a verify forward (target), or in the draft worker's fixed-width
        window forward (draft-extend); sets KV reserved per step, windows, metadata and graphs."""
        return num_draft_tokens

    def get_num_tokens_per_bs_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        """SGLang's older name of `get_num_tokens_per_req_for_target_verify`."""
        return self.get_num_tokens_per_req_for_target_verify(num_draft_tokens, is_draft_worker)

    def carries_draft_hidden_states(self) -> bool:
        """Does the PD handoff carry the draft's hidden state?"""
        return True

    def has_draft_kv(self) -> bool:
        """Does the draft keep its own KV (moved with the target's in PD)?"""
        return self.needs_draft_model()

    def need_topk(self) -> bool:
        """Does the FutureMap relay the draft's top-k between iterations?"""
        return True

    def needs_draft_model(self) -> bool:
        return True

    def create_future_map(
        self,
        max_running_requests: int,
        chunked_prefill_size: int,
        context_len: int,
        device: Any,
        *,
        debug: bool = False,
    ) -> "FutureMap":
        """The overlap relay the scheduler builds at start-up (rows per request slot)."""
        from engine.future_map import FutureMap

        return FutureMap(
            max_running_requests + 1,
            device,
            need_topk=self.need_topk(),
            need_hidden=self.carries_draft_hidden_states(),
            debug=debug,
        )

    def build_disagg_draft_input(
        self, batch: "Batch", config: "SpecConfig", last_tokens: Any, future_map: "FutureMap | None"
    ) -> Any:
        """PD decode: turn a PREBUILT batch's handoff (each `Req.handoff`, decoded by the worker's
        handoff codec) into this algorithm's draft input; with a `future_map`, also seed the
        requests' rows. Raises DisaggHandoffError naming the requests it cannot serve."""
        from spec.draft_input import bonus_draft_input

        return bonus_draft_input(batch, last_tokens, future_map, self.name)

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
    """Plain decoding under its registry name: the engine's own PlainDecoding does the work (its
    FutureMap, which relays no top-k or hidden state, follows from the hooks below)."""

    name = "NONE"
    _plain = PlainDecoding()

    def is_speculative(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def needs_draft_model(self) -> bool:
        return False

    def create_worker(self, parts: "EngineParts", config: "SpecConfig") -> "Executor":
        return self._plain.create_worker(parts)


class _Eagle(SpeculativeAlgorithm):
    name = "EAGLE"
    draft_format = "eagle"

    def is_eagle(self) -> bool:
        return True

    def build_disagg_draft_input(
        self, batch: "Batch", config: "SpecConfig", last_tokens: Any, future_map: "FutureMap | None"
    ) -> Any:
        from spec.eagle_disagg import build_eagle_disagg_draft_input

        return build_eagle_disagg_draft_input(batch, config, last_tokens, future_map)

    def create_worker(self, parts: "EngineParts", config: "SpecConfig") -> "Executor":
        from spec.eagle_worker import EagleWorker

        return EagleWorker.create(parts, config, self.draft_format, self)


class _Eagle3(_Eagle):
    name = "EAGLE3"
    draft_format = "eagle3"

    def is_eagle3(self) -> bool:
        return True


_BUILTINS: dict[str, SpeculativeAlgorithm] = {a.name: a for a in (_NoSpec(), _Eagle(), _Eagle3())}
SpeculativeAlgorithm.NONE = _BUILTINS["NONE"]
SpeculativeAlgorithm.EAGLE = _BUILTINS["EAGLE"]
SpeculativeAlgorithm.EAGLE3 = _BUILTINS["EAGLE3"]
RESERVED_NAMES = frozenset(_BUILTINS) | {"NEXTN"}
_PLUGINS: dict[str, SpeculativeAlgorithm] = {}
_entry_points_loaded = False


class CustomSpecAlgo(SpeculativeAlgorithm):
    """Base class of plugin algorithms: override `create_worker` (required) and any other hook.
    Every `is_*` query answers False (but `is_some` / `is_speculative`) unless overridden."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("create_worker",)


# every public method of the interface a plugin must end up with
INTERFACE = tuple(
    n for n, v in vars(SpeculativeAlgorithm).items() if callable(v) and not n.startswith("_") and n != "from_name"
)


def _adopt_old_hook_names(cls: type) -> None:
    """Plugins ported from older SGLang name the verify-width hook `..._per_bs_...`; when a plugin
    defines only that name, the new name forwards to it (the base class forwards the other way)."""
    if not any(
        "get_num_tokens_per_bs_for_target_verify" in vars(c)
        for c in cls.__mro__
        if c not in (SpeculativeAlgorithm, CustomSpecAlgo, object)
    ):
        return
    if any(
        "get_num_tokens_per_req_for_target_verify" in vars(c)
        for c in cls.__mro__
        if c not in (SpeculativeAlgorithm, CustomSpecAlgo, object)
    ):
        return
    old = cls.get_num_tokens_per_bs_for_target_verify

    def forward(self: Any, num_draft_tokens: int, is_draft_worker: bool) -> int:
        warnings.warn(
            f"{cls.__name__}.get_num_tokens_per_bs_for_target_verify is deprecated; "
            "rename it get_num_tokens_per_req_for_target_verify",
            DeprecationWarning,
            stacklevel=2,
        )
        return old(self, num_draft_tokens, is_draft_worker)

    cls.get_num_tokens_per_req_for_target_verify = forward  # type: ignore[attr-defined]


def check_conforms(cls: type) -> None:
    if not (isinstance(cls, type) and issubclass(cls, CustomSpecAlgo)):
        raise SpecRegistryError(f"{cls!r} must be a subclass of CustomSpecAlgo")
    missing = [n for n in INTERFACE if not callable(getattr(cls, n, None))]
    not_overridden = [n for n in CustomSpecAlgo.REQUIRED if getattr(cls, n) is getattr(SpeculativeAlgorithm, n)]
    if missing or not_overridden:
        raise SpecRegistryError(
            f"{cls.__name__} does not implement the speculative interface: missing {missing + not_overridden}"
        )
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
        raise SpecRegistryError(
            f"speculative algorithm {name!r} is already registered by {type(_PLUGINS[key]).__name__}"
        )
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


class AlgorithmBinding:
    """An algorithm bound to its resolved settings: what `Engine(config, algorithm=...)` takes
    (engine/algorithm.py's EngineAlgorithm) and what nodes ask about the algorithm."""

    def __init__(self, algorithm: SpeculativeAlgorithm, config: "SpecConfig") -> None:
        self.algorithm, self.config = algorithm, config

    @property
    def name(self) -> str:
        return self.algorithm.name

    def create_worker(self, parts: "EngineParts") -> "Executor":
        return self.algorithm.create_worker(parts, self.config)

    def create_future_map(
        self,
        max_running_requests: int,
        chunked_prefill_size: int,
        context_len: int,
        device: Any,
        *,
        debug: bool = False,
    ) -> "FutureMap":
        return self.algorithm.create_future_map(
            max_running_requests, chunked_prefill_size, context_len, device, debug=debug
        )

    def draft_model_dir(self) -> str | None:
        return self.config.draft_model_path if self.algorithm.has_draft_kv() else None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"algorithm": self.name}
        if self.algorithm.is_speculative():
            c = self.config
            out.update(
                num_steps=c.num_steps,
                eagle_topk=c.eagle_topk,
                num_draft_tokens=c.num_draft_tokens,
                draft_model_path=c.draft_model_path,
            )
            adaptive = c.adaptive_policy_config()
            if adaptive is not None:
                out["adaptive"] = adaptive.to_json()
        return out


def bind(config: "SpecConfig") -> AlgorithmBinding:
    """Resolve and check the settings, find the algorithm; fails fast (before any model load)
    with a SpecConfigError / SpecRegistryError naming the flag or listing known algorithms."""
    cfg = config.resolved()
    algo = SpeculativeAlgorithm.from_name(cfg.algorithm)
    if algo.needs_draft_model() and not cfg.draft_model_path:
        raise SpecRegistryError(f"--speculative-algorithm {algo.name} needs --speculative-draft-model-path")
    return AlgorithmBinding(algo, cfg)


__all__ = [
    "AlgorithmBinding",
    "CustomSpecAlgo",
    "SpeculativeAlgorithm",
    "SpecRegistryError",
    "bind",
    "register",
    "registered_names",
]
