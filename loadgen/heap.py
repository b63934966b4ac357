"""The load generator's heap kept still while a point runs, and the collector's pauses counted.

A load generator that imported torch (a bench that writes its checkpoint) holds a few hundred
thousand objects; a full collection walks them all while every stream waits, and the pause reads as
the service's silence in the records (a CPU run: 86 ms against instant nodes). Freezing what is alive
when a point starts was not enough: full collections still come every few tens of thousands of
objects the point keeps, and each walks all of the point's own objects (its streams, its records),
so they grow as the point goes on; on two H200s they were 130-240 ms in half the draws of a goodput
run (bench/RESULTS.md, twenty-ninth run). So a point also runs with full collections off (the
oldest generation's threshold out of reach): young collections still free the cycles the point
drops, in a few ms at most, and what reaches the oldest generation waits for the collection that
settles the next point. (Python 3.14's incremental collector bounds its pauses by itself.)
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator


NO_FULL_COLLECTIONS = 2**31 - 1  # the oldest generation's threshold while a point runs


@contextmanager
def settled_heap() -> Iterator[None]:
    """Collect, freeze every live object (gc.freeze) and put full collections out of reach for the
    block; after it, the thresholds are as they were and the heap thawed, so what the block drops
    is collected by later points. Inside a settled block (anything frozen already) it does nothing:
    the outer block restores."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(*thresholds[:2], NO_FULL_COLLECTIONS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
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
