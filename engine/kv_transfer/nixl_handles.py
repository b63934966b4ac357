"""A NIXL write in flight (NixlXfer) and the small helpers around NIXL handles, names and descriptors."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.kv_transfer.base import KVPoll, MemoryLayout, TransferError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class NixlXfer:
    """A posted write: NIXL handles posted in order; only the last one carries the tag."""

    room: int
    peer: str
    stages: list[Any]
    deadline: float
    nbytes: int
    stage: int = 0
    state: KVPoll = KVPoll.TRANSFERRING
    error: str | None = None
    started: float = field(default_factory=time.monotonic)


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def md_agent_name(md: bytes) -> str | None:
    """The agent name inside NIXL metadata ("nixlSerDes|Agent" + u64 length + name), or None
    if the format is not what nixl-cu13 1.5 writes. Only a hint: NIXL still parses the bytes."""
    head = b"nixlSerDes|Agent"
    if not md.startswith(head) or len(md) < len(head) + 8:
        return None
    n = int.from_bytes(md[len(head) : len(head) + 8], "little")
    raw = md[len(head) + 8 : len(head) + 8 + n]
    return raw.decode(errors="replace") if 0 < n == len(raw) else None


def fail_xfer(x: NixlXfer, why: str) -> KVPoll:
    if x.state != KVPoll.SUCCESS:
        x.state = KVPoll.FAILED
        x.error = x.error or why
    return x.state


def release_all(stages: list[Any]) -> None:
    for h in stages:
        try:
            h.release()
        except Exception as e:  # an in-flight handle NIXL could not cancel; it keeps it
            log.warning("releasing a NIXL transfer handle failed: %s", err_text(e))


def post_stages(agent: Any, x: NixlXfer) -> None:
    """Post stage x.stage of a write; a stage that completes inside the call moves on to the next
    (the transport's lock held)."""
    while x.stage < len(x.stages):
        try:
            st = agent.transfer(x.stages[x.stage])
        except Exception as e:
            fail_xfer(x, f"room {x.room} -> {x.peer}: {err_text(e)}")
            return
        if st == "ERR":
            fail_xfer(x, f"room {x.room} -> {x.peer}: posting stage {x.stage} failed")
            return
        if st != "DONE":
            return
        x.stage += 1
    x.state = KVPoll.SUCCESS


def as_xfer(handle: object) -> NixlXfer:
    if not isinstance(handle, NixlXfer):
        raise TypeError(f"not a NixlTransport handle: {handle!r}")
    return handle


def as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def aux_desc(layout: MemoryLayout, row: int) -> np.ndarray:
    a = layout.aux
    return np.array([[a.addr + row * a.item_bytes, a.item_bytes, a.device_id]], dtype=np.uint64)


def check_items(what: str, items: Sequence[int], count: int) -> None:
    # Item 0 (page or row) is reserved padding: a request never owns it, so seeing it is a bug.
    arr = np.asarray(items, dtype=np.int64)
    bad = arr[(arr <= 0) | (arr >= count)]
    if bad.size:
        raise TransferError(f"{what} {int(bad[0])} out of range 1..{count - 1}")


__all__ = [
    "NixlXfer",
    "as_str",
    "as_xfer",
    "aux_desc",
    "check_items",
    "err_text",
    "fail_xfer",
    "md_agent_name",
    "post_stages",
    "release_all",
]
