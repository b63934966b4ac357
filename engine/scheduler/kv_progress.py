"""Chunked prefill of a request whose KV leaves the node: which pages are final after each chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core import Batch, ForwardMode
from engine.device_event import DeviceEvent, make_event


@dataclass(frozen=True, slots=True)
class KVProgress:
    """After a non-final prompt chunk of a `hold_kv` request: its first `len(pages)` pages hold
    final KV in every pool (the draft's too: a prompt chunk's shifted tokens are all known) once
    `fence` is reached. An empty page list after a retraction voids everything reported before."""

    pages: tuple[int, ...]
    fence: DeviceEvent

    @property
    def restarted(self) -> bool:
        return not self.pages


def needs_fence(batch: Batch) -> bool:
    """A prompt chunk of a request whose KV another node will read before the prompt ends."""
    return batch.mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and any(
        r.hold_kv and not s for r, s in zip(batch.reqs, batch.sample)
    )


def record_fence(device: torch.device) -> DeviceEvent:
    """A point on the launching stream after the batch's forwards (already reached on CPU).
    Blocking: the prefill's writer waits on it from another thread while the scheduler launches
    the next chunk."""
    event = make_event(device, blocking=True)
    event.record()
    return event
