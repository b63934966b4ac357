"""What the scheduler publishes per request and step, and the queues it takes requests from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.core import FinishReason, Req, StepOutput
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


def step_update(req: Req, kept: list[int], out: StepOutput, i: int) -> RequestUpdate:
    """The update of batch row `i` whose `kept` tokens were appended: its logprobs and top
    logprobs (recorded on the request too) and accepted drafts, as far as the tokens kept."""
    upd = RequestUpdate(req.rid, kept, prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens)
    if out.logprobs is not None:
        upd.logprobs = out.logprobs[i][: len(kept)]
        req.output_logprobs.extend(upd.logprobs)
    if out.top_logprobs is not None:
        upd.top_logprobs = out.top_logprobs[i][: len(kept)]
        req.output_top_logprobs.extend(upd.top_logprobs)
    if out.accepted_drafts is not None:
        upd.accepted_drafts = out.accepted_drafts[i]
    return upd


class SchedulerIO(Protocol):
    """Where requests come from and updates go to (in-process queues, or a node's gRPC servicer)."""

    def poll(self) -> tuple[list[Req], list[str]]:
        """New requests and ids to abort, since the last call."""

    def publish(self, updates: list[RequestUpdate]) -> None: ...

    def wait_for_work(self, timeout: float) -> None:
        """Block until something arrives or the timeout passes (only called when idle)."""
