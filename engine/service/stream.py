"""One request's response stream: engine updates (scheduler thread) -> gRPC responses (asyncio).

Also where stop strings are enforced on a node: the node has the tokenizer, so it decodes the
tail incrementally and ends the request at the first stop string (SMG/the router trim the text).

After its first message, a stream gathers at least `--stream-interval` tokens per message (SGLang's
flag of that name), or the request's own `stream_interval` where that is larger: every message
costs the router a read, a relay and an SSE write on its one event loop, so at high rates fewer,
larger messages let one router carry more streams, at the cost of tokens arriving in groups. The
default, auto, sends a token a message until the node streams more tokens a second than its
message budget (common/stream_pacer.py). The end of a stream always goes out at once.

The scheduler thread hands a step's updates to the event loop in one wake-up (UpdateMailbox), not
one per request: each `call_soon_threadsafe` writes the loop's self-pipe, which releases the GIL to
the event loop, and the scheduler thread then waits for it back. A stream whose updates queue up
while the loop is busy sends them as one message, so a loop behind the engine catches up instead of
falling further behind. A decode node streaming 200 requests otherwise spent several ms of each
step publishing (bench/stream_overhead.py).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import AsyncIterator, Protocol

from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.core import FinishReason, Req
from engine.scheduler import RequestUpdate
from engine.service import convert
from common.detokenize import TextAssembler
from common.tokenizer import Tokenizer
from common.stream_pacer import DEFAULT_MESSAGES_PER_S, StreamPacer


_pacer = StreamPacer(fixed=1)  # the node's tokens per message after the first (one setting a process)


def set_stream_interval(setting: str | int, messages_per_s: float = DEFAULT_MESSAGES_PER_S) -> StreamPacer:
    """The node's `--stream-interval` (N, or auto within `messages_per_s`); returns its pacer."""
    global _pacer
    _pacer = StreamPacer(parse_stream_interval(setting), messages_per_s)
    return _pacer


def stream_pacer() -> StreamPacer:
    """The node's pacer, as `--stream-interval` last set it (its metrics read it at each scrape)."""
    return _pacer


def parse_stream_interval(setting: str | int) -> int | None:
    """`--stream-interval`'s value: a token count >= 1, or None for auto."""
    if isinstance(setting, str) and setting.strip().lower() == "auto":
        return None
    try:
        tokens = int(setting)
    except ValueError:
        raise ValueError(f"--stream-interval must be auto or a token count >= 1, got {setting!r}") from None
    if tokens < 1:
        raise ValueError(f"--stream-interval must be >= 1 or auto, got {tokens}")
    return tokens


class Aborter(Protocol):
    """Whoever can end a request early (the engine loop, or the PD facade over it)."""

    def abort(self, rid: str, reason: str = "aborted") -> None: ...


class UpdateMailbox:
    """Updates for the streams of one event loop, handed over in one wake-up per batch."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._lock = threading.Lock()
        self._pending: deque[tuple[RequestStream, RequestUpdate]] = deque()
        self._scheduled = False  # a delivery is queued on the loop and has not yet taken the batch

    def post(self, stream: RequestStream, upd: RequestUpdate) -> None:
        """Called in the scheduler thread: only the first update of a batch wakes the loop."""
        with self._lock:
            self._pending.append((stream, upd))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._aio.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is left to read
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, deque()
            self._scheduled = False
        for stream, upd in batch:
            stream.deliver(upd)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, UpdateMailbox] = weakref.WeakKeyDictionary()


def mailbox(aio: asyncio.AbstractEventLoop) -> UpdateMailbox:
    """The loop's mailbox (made on first use; called on the loop's thread)."""
    box = _MAILBOXES.get(aio)
    if box is None:
        box = _MAILBOXES[aio] = UpdateMailbox(aio)
    return box


class RequestStream:
    def __init__(
        self, loop: Aborter, req: Req, stream: bool, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int]
    ) -> None:
        self.loop, self.req, self.stream = loop, req, stream
        self.eos = eos_token_ids
        self._mailbox = mailbox(asyncio.get_running_loop())
        self._queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        p = req.params
        self._text = (
            TextAssembler(tokenizer, p.stop, req.prompt_ids, p.min_new_tokens, p.skip_special_tokens)
            if (tokenizer and p.stop)
            else None
        )
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list = []
        self.accepted_drafts = 0
        self.verifies = 0
        self.finished = False
        self.pacer = _pacer

    def on_update(self, upd: RequestUpdate) -> None:
        """Called in the scheduler thread."""
        self._mailbox.post(self, upd)

    def _interval(self) -> int:
        """Tokens a message gathers after the first: the node's setting, or the request's own
        (a router whose relay is past its budget asks for more) where that is larger."""
        return max(self.pacer.interval, self.req.params.stream_interval)

    def deliver(self, upd: RequestUpdate) -> None:
        """Called on the event loop (the mailbox's delivery)."""
        if self.stream and upd.tokens:
            self.pacer.observe(len(upd.tokens))
        self._queue.put_nowait(upd)

    async def _updates(self) -> list[RequestUpdate]:
        """The next update and every one queued behind it, up to the first that finishes."""
        batch = [await self._queue.get()]
        while not batch[-1].finished and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        rid, n_prompt = self.req.rid, len(self.req.prompt_ids)
        held: list[RequestUpdate] = []  # taken but not sent: fewer than `interval` tokens so far
        spoke = False  # the first message goes out at once (TTFT), later ones every `interval` tokens
        try:
            while True:
                batch = await self._updates()
                taken, end = self._take(batch)
                held += taken
                tokens = [t for upd in held for t in upd.tokens]
                due = not spoke or len(tokens) >= self._interval() or end is not None
                if tokens and self.stream and due:
                    yield convert.chunk(
                        rid,
                        tokens,
                        n_prompt,
                        len(self.output_ids),
                        [x for upd in held for x in upd.logprobs] or None,
                        [x for upd in held for x in upd.top_logprobs] or None,
                        cached_tokens=held[-1].cached_tokens,
                    )
                    spoke = True
                if due or not tokens:
                    held = []
                if end is not None:
                    self.finished = True
                    upd, reason, matched = end
                    if matched is None:
                        matched = convert.matched_stop_token(upd, self.req.params.stop_token_ids, self.eos)
                    if reason is FinishReason.ABORT and upd.finish_detail not in ("", "aborted"):
                        raise RequestFailed(upd.finish_detail)
                    yield convert.complete(
                        rid,
                        self.output_ids,
                        reason,
                        n_prompt,
                        logprobs=self.logprobs or None,
                        top=self.top or None,
                        matched_stop=matched,
                        accepted_drafts=self.accepted_drafts,
                        verifies=self.verifies,
                        cached_tokens=upd.cached_tokens,
                    )
                    return
        finally:
            if not self.finished:  # the client went away (or the handler was cancelled)
                self.loop.abort(rid, "client cancelled")

    def _take(
        self, batch: list[RequestUpdate]
    ) -> tuple[list[RequestUpdate], tuple[RequestUpdate, FinishReason | None, str | int | None] | None]:
        """Records `batch`'s updates up to the one that ends the stream (its own finish, or a stop
        string its tokens complete: the scheduler frees the request on its next step); returns
        those taken and, when one ends it, (that update, finish reason, matched stop)."""
        taken: list[RequestUpdate] = []
        for upd in batch:
            reason, matched, finished = upd.finish_reason, None, upd.finished
            if self._text is not None and upd.tokens and not finished:
                _, hit = self._text.feed(upd.tokens)
                if hit:
                    self.loop.abort(self.req.rid, "stop string")
                    finished, reason, matched = True, FinishReason.STOP, self._text.matched
            self._record(upd)
            taken.append(upd)
            if finished:
                return taken, (upd, reason, matched)
        return taken, None

    def _record(self, upd: RequestUpdate) -> None:
        self.output_ids += upd.tokens
        self.logprobs += upd.logprobs
        self.top += upd.top_logprobs
        if upd.accepted_drafts is not None:
            self.accepted_drafts += upd.accepted_drafts
            self.verifies += 1


class RequestFailed(RuntimeError):
    """A request ended with an error; the servicer maps it to a gRPC status. `kind` is a short,
    fixed label for metrics (never free text: it is a Prometheus label value). `blame` names the
    role of the node at fault when that is not this one (a decode whose prefill peer failed it):
    the servicer sends it as trailing metadata, so the router charges the right node."""

    def __init__(self, message: str, kind: str = "other", blame: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.blame = kind, blame

    @classmethod
    def refused_alone(cls, role: str, work: str, flag: str) -> RequestFailed:
        """A request sent to a PD node alone (no partner) that the node's settings refuse: the
        router retries it elsewhere, since it is the node's setting, not the request's fault."""
        return cls(
            f"this {role} node does not {work} itself ({flag} 0): send disaggregated_params.bootstrap_host",
            "local_refused",
            blame=role,
        )
