"""What the engine asks of a (speculative) algorithm, declared here so the engine never imports one.

spec/ binds an algorithm and its settings into an object of this shape; an Engine built without
one decodes plainly. The scheduler's start-up builds the FutureMap through `create_future_map`
(SGLang's argument order), for every algorithm, plain decoding included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.config import EngineConfig, ModelConfig
from engine.future_map import FutureMap, plain_future_map
from engine.kv_cache import KVCacheManager
from engine.model_runner import ModelRunner
from engine.parallel.group import SINGLE, TpGroup
from engine.sampler import Sampler
from engine.worker import PlainExecutor

if TYPE_CHECKING:
    from engine.executor import Executor


@dataclass
class EngineParts:
    """What an executor factory may build on: the loaded target and the shared KV machinery."""

    config: EngineConfig
    model_config: ModelConfig
    runner: ModelRunner
    kv: KVCacheManager
    sampler: Sampler
    device: torch.device
    dtype: torch.dtype
    tp: TpGroup = SINGLE  # this rank's tensor-parallel group (draft heads run replicated on each)


class EngineAlgorithm(Protocol):
    """An algorithm bound to its settings, as the engine sees it."""

    @property
    def name(self) -> str: ...

    def create_worker(self, parts: "EngineParts") -> "Executor":
        """The executor that runs this algorithm on the loaded target."""

    def create_future_map(
        self,
        max_running_requests: int,
        chunked_prefill_size: int,
        context_len: int,
        device: torch.device | str,
        *,
        debug: bool = False,
    ) -> FutureMap:
        """The overlap relay this algorithm needs (rows per request slot)."""

    def describe(self) -> dict[str, Any]:
        """Settings to log and report (name, steps, widths ...)."""

    def draft_model_dir(self) -> str | None:
        """The draft model that keeps its own KV over the target's pages (None: none), so the KV
        cache can be sized for both before the draft loads."""


class PlainDecoding:
    """The engine's own default: the target alone, no drafts (spec/ supplies everything else)."""

    name = "plain"

    def create_worker(self, parts: "EngineParts") -> "Executor":
        return PlainExecutor(parts.runner, parts.sampler)

    create_future_map = staticmethod(plain_future_map)

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.name}

    def draft_model_dir(self) -> str | None:
        return None


def slot_future_map(
    algorithm: EngineAlgorithm,
    max_running: int,
    chunked_prefill_size: int,
    context_len: int,
    num_slots: int,
    device: torch.device | str,
    debug: bool = False,
) -> FutureMap:
    """The algorithm's relay, checked to have a row for each of `num_slots` request slots (the
    scheduler's, and each follower rank's own copy under tensor parallelism)."""
    future_map = algorithm.create_future_map(max_running, chunked_prefill_size, context_len, device, debug=debug)
    if future_map.num_rows < num_slots:
        raise ValueError(
            f"{algorithm.name}: create_future_map gave {future_map.num_rows} rows; "
            f"{num_slots} request slots need one each"
        )
    return future_map
