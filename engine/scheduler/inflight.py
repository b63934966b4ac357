"""A launched, not yet collected batch, and what it adds to its requests: the overlap scheduler's counts.

The host knows what a batch in flight will add only as counts: KV tokens (exact for extend and
plain decode, an upper bound under speculation: the batch's planned window) and tokens it will
sample. A request's pages and slot go back only once no batch in flight holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core import Batch, ForwardMode


@dataclass(slots=True)
class Launched:
    """The batch in flight: its executor handle, when its launch began and how long it took."""

    batch: Batch
    handle: Any
    at: float  # perf_counter at launch
    launch_s: float  # host time the launch itself took


def launched_window(batch: Batch, n: int) -> int:
    """KV slots a request with `n` query tokens may write in `batch`."""
    return n if batch.mode is ForwardMode.EXTEND or batch.mode is ForwardMode.MIXED else batch.window


def samples_grammar(batch: Batch) -> bool:
    """The batch samples a token a constrained request's next mask depends on (so it is collected
    before the next batch is formed: no mask from stale state)."""
    return any(r.grammar is not None for r, s in zip(batch.reqs, batch.sample) if s)


def mark_launched(batch: Batch) -> None:
    batch.epochs = [r.epoch for r in batch.reqs]
    for req, n, s in zip(batch.reqs, batch.extend_lens, batch.sample):
        req.inflight += 1
        req.inflight_len += launched_window(batch, n)
        req.inflight_samples += int(s)


def unmark_launched(batch: Batch, i: int) -> None:
    """Request `i` of `batch` no longer waits for it (collected, or its step failed)."""
    req = batch.reqs[i]
    req.inflight -= 1
    req.inflight_len -= launched_window(batch, batch.extend_lens[i])
    req.inflight_samples -= int(batch.sample[i])


__all__ = ["launched_window", "mark_launched", "unmark_launched"]
