"""What the scheduler publishes per request and step, and the queues it takes requests from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.core import FinishReason, Req
from engine.scheduler.kv_progress import KVProgress


@dataclass(slots=True)
class RequestUpdate:
    """New tokens of one request from one step, and whether it ended."""

    rid: str
    tokens: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of them, found in the prefix cache
    accepted_drafts: int | None = None
    kv_progress: KVProgress | None = None  # hold_kv requests: pages final after a prompt chunk
    held_pages: tuple[int, ...] | None = None  # a hold_kv request that finished: all its pages


def final_update(req: Req) -> RequestUpdate:
    """The update that ends `req` (its finish reason and counts, no new tokens)."""
    return RequestUpdate(
        req.rid,
        [],
        True,
        req.finish_reason,
        req.finish_detail,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens,
    )


class SchedulerIO(Protocol):
    """Where requests come from and updates go to (in-process queues, or a node's gRPC servicer)."""

    def poll(self) -> tuple[list[Req], list[str]]:
        """New requests and ids to abort, since the last call."""

    def publish(self, updates: list[RequestUpdate]) -> None: ...

    def wait_for_work(self, timeout: float) -> None:
        """Block until something arrives or the timeout passes (only called when idle)."""
