"""A scripted `Dispatcher` for the router's HTTP tests: no nodes, no torch, deterministic events.

Each job gets a `Script` (from a callable, so tests can vary it per request id or prompt): a reply
text split into one-token events, an optional DispatchError before the first event or after some
events, a per-event delay and an optional hang. The dispatcher records every job it was given and
every job whose iterator was cancelled or closed before its FinishEvent (what aborts both legs).
Also the harness the tests share: a real uvicorn server in a thread, SSE parsing, bounded waits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import AsyncGenerator, Callable, Iterator, TypeVar

import uvicorn
from starlette.types import ASGIApp

from common.tokenizer import Tokenizer
from router.contract import DispatchError, FinishEvent, GenerationJob, ModelCard, TokenEvent

T = TypeVar("T")


@dataclass
class Script:
    reply: str = "Hello world"
    finish_reason: str | None = None  # None: "length" when max_new_tokens cuts the reply, else "stop" + EOS
    matched_stop: int | str | None = None
    error_before: DispatchError | None = None
    error_after: int | None = None  # raise a DispatchError after this many token events
    delay_s: float = 0.0
    hang: bool = False  # after the reply, wait forever (until cancelled) instead of finishing
    disaggregated: bool = True
    tokens: list[int] | None = None  # explicit token ids instead of encoding `reply`
    chunk: int = 1  # tokens per TokenEvent


@dataclass
class FakeDispatcher:
    tokenizer: Tokenizer
    script: Callable[[GenerationJob], Script] = field(default=lambda job: Script())
    max_context_length: int = 128
    is_ready: bool = True
    has_model: bool = True
    jobs: list[GenerationJob] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)

    def model(self) -> ModelCard | None:
        if not self.has_model:
            return None
        return ModelCard(
            name="tiny",
            tokenizer_path=self.tokenizer.name_or_path,
            max_context_length=self.max_context_length,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )

    def ready(self) -> bool:
        return self.is_ready

    def generate(self, job: GenerationJob) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        self.jobs.append(job)
        return self._run(job, self.script(job))

    def events_for(self, job: GenerationJob, s: Script) -> list[TokenEvent | FinishEvent]:
        """The events a script yields for a job (tests use it to compute expected text)."""
        ids = list(s.tokens) if s.tokens is not None else self.tokenizer.encode(s.reply, add_special_tokens=False)
        eos = self.tokenizer.eos_token_ids[0]
        budget = job.sampling.max_new_tokens
        reason, matched = s.finish_reason, s.matched_stop
        if reason is None:
            if len(ids) + 1 > budget:
                ids, reason = ids[:budget], "length"
            else:
                ids, reason, matched = [*ids, eos], "stop", eos
        out: list[TokenEvent | FinishEvent] = []
        for k in range(0, len(ids), s.chunk):
            part = tuple(ids[k : k + s.chunk])
            lps = tuple(-0.5 for _ in part) if job.sampling.logprobs else ()
            tops = (
                tuple(tuple((t + d, -0.5 - d) for d in range(job.sampling.top_logprobs)) for t in part)
                if job.sampling.logprobs
                else ()
            )
            out.append(TokenEvent(part, lps, tops))
        out.append(FinishEvent(reason, len(job.input_ids), len(ids), matched, s.disaggregated))
        return out

    async def _run(self, job: GenerationJob, s: Script) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        self.started.append(job.request_id)
        events = self.events_for(job, s)
        try:
            if s.error_before is not None:
                raise s.error_before
            for k, event in enumerate(events):
                if s.hang and isinstance(event, FinishEvent):
                    await asyncio.Event().wait()  # a node that never finishes; only cancellation ends it
                if s.error_after is not None and k == s.error_after:
                    raise DispatchError(502, "decode node died mid-stream", before_first_token=False)
                if s.delay_s:
                    await asyncio.sleep(s.delay_s)
                if isinstance(event, FinishEvent):
                    # Before the yield: the consumer may close us right after taking it, which is
                    # the normal end, not a cancellation.
                    self.finished.append(job.request_id)
                yield event
        except (GeneratorExit, asyncio.CancelledError):
            if job.request_id not in self.finished:
                self.cancelled.append(job.request_id)
            raise


# --- harness shared by the router's HTTP tests ---------------------------------------------------------


@contextmanager
def server(app: ASGIApp) -> Iterator[str]:
    """A real uvicorn server on an ephemeral 127.0.0.1 port, in a thread; stopped on exit."""
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def sse_lines(body: str) -> list[str]:
    """The `data:` payloads of an event stream, checking its framing."""
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), body
    return [e[len("data: ") :] for e in events]
