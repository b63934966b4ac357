"""The load generator's heap kept still while a point runs, and the collector's pauses counted.

A load generator that imported torch (a bench that writes its checkpoint) holds a few hundred
thousand objects; a full collection walks them all while every stream waits, and the pause reads as
the service's silence in the records (a CPU run: 86 ms against instant nodes). Freezing what is alive
when a point starts was not enough: with the old objects frozen the collector counts almost nothing
as long-lived, so the point's own objects (its streams, its records) set off a full collection
within seconds, and on two H200s those pauses were 130-240 ms in half the draws of a goodput run
(bench/RESULTS.md, twenty-ninth run). So a point runs with automatic collection off: reference
counting still frees what the point drops, and the cycles it leaves wait for the collection that
settles the next point.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator


@contextmanager
def settled_heap() -> Iterator[None]:
    """Collect, freeze every live object (gc.freeze) and turn automatic collection off for the
    block; after it, collection is back on as it was and the heap thawed, so what the block drops
    is collected by later points. Inside a settled block (anything frozen already) it does nothing:
    the outer block restores."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()


@dataclass
class GcPauses:
    """The collector's pauses while started: per generation, how many and the worst and total ms."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    worst_ms: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    total_ms: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    _since: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        elif self._since is not None:
            ms, g = (time.perf_counter() - self._since) * 1e3, int(info["generation"])
            self.count[g] += 1
            self.worst_ms[g] = max(self.worst_ms[g], ms)
            self.total_ms[g] += ms
            self._since = None

    def start(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def stop(self) -> dict[str, float]:
        """gc_full_collections (generation 2) and the worst and total pause in ms over all of them."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)
        return {
            "gc_full_collections": self.count[2],
            "gc_pause_ms_max": max(self.worst_ms),
            "gc_pause_ms_total": sum(self.total_ms),
        }
