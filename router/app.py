"""The router's HTTP side: OpenAI /v1/completions and /v1/chat/completions over a `Dispatcher`.

A request is authenticated, size-checked, parsed and validated (400s in OpenAI's shape), tokenized
here (the router owns text), turned into one `GenerationJob` per choice and fanned out to the
dispatcher. A stream is held back until its first event arrives, so a dispatch failure before it
still gets a real HTTP status; after it, errors become an SSE error event followed by [DONE]. A
client that goes away (stream or not) cancels the dispatcher iterators, which aborts both legs.

finish_reason "abort" (a node gave the request up) is passed through as is: the openai client
parses it (its models are built without validation), and mapping it to "stop" would present a
truncated answer as complete.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import suppress
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pdserve.tokenizer import ChatTemplateError, Tokenizer
from router.contract import Dispatcher, DispatchError, FinishEvent, GenerationJob, ModelCard, TokenEvent
from router.errors import APIError, bad_request, from_dispatch_error, from_validation_error, install_handlers
from prometheus_client import CollectorRegistry

from router.metrics import ResponseCounter, RouterMetrics
from router.protocol import (ChatCompletionRequest, CompletionRequest, Shapes, build_jobs, check_ids,
                             context_budget, read_body)
from router.text import ChoiceText, RequestOutput

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_PROMPTS = 64  # prompts in one batched completions request
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy endpoint's documented default
_DONE = "data: [DONE]\n\n"
ABORT_WAIT_S = 5.0  # how long closing a request waits for its jobs' iterators to abort
T = TypeVar("T")
Item = tuple[int, TokenEvent | FinishEvent]


class Fanout:
    """Runs the n jobs of one request concurrently and merges their events into one queue.

    Each job's iterator is consumed by its own task, so cancelling the task (stop string hit,
    client gone, request over) closes exactly that iterator, which aborts both of its legs.
    """

    def __init__(self, dispatcher: Dispatcher, jobs: list[GenerationJob]) -> None:
        self._dispatcher, self._jobs = dispatcher, jobs
        self._queue: asyncio.Queue[tuple[int, TokenEvent | FinishEvent | DispatchError]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._live = set(range(len(jobs)))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(i, job)) for i, job in enumerate(self._jobs)]

    async def _pump(self, i: int, job: GenerationJob) -> None:
        it: AsyncIterator[TokenEvent | FinishEvent] | None = None
        try:
            it = self._dispatcher.generate(job)
            async for event in it:
                self._queue.put_nowait((i, event))
                if isinstance(event, FinishEvent):
                    return
            raise DispatchError(502, "a node stream ended without a finish event", before_first_token=False)
        except DispatchError as e:
            self._queue.put_nowait((i, e))
        except Exception as e:  # a dispatcher bug must still end the request, with a 502
            self._queue.put_nowait((i, DispatchError(502, f"dispatch failed: {type(e).__name__}: {e}")))
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    async def next(self) -> Item | None:
        """The next event of a live job; None once every job finished; raises a job's DispatchError."""
        while self._live:
            i, item = await self._queue.get()
            if i not in self._live:
                continue  # a job we cancelled after its stop string: its leftovers do not count
            if isinstance(item, DispatchError):
                raise item
            if isinstance(item, FinishEvent):
                self._live.discard(i)
            return i, item
        return None

    async def cancel(self, i: int) -> None:
        self._live.discard(i)
        self._tasks[i].cancel()
        await asyncio.wait([self._tasks[i]], timeout=ABORT_WAIT_S)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        # Bounded: a dispatcher whose abort hangs must not hold the request (or shutdown) forever.
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=ABORT_WAIT_S)


class SSEResponse(StreamingResponse):
    """An event stream that notices a disconnect whatever the ASGI spec version (Starlette relies on
    a failing send under 2.4, which never comes while the node is silent), then always closes the
    event generator and runs `cleanup` (aborting the jobs)."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._cleanup()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> tuple[T | None, bool]:
    """(result, False), or (None, True) if the client went away first (then `work` is cancelled)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result(), False
    with suppress(asyncio.CancelledError):
        await task
    return None, True


class _Serving:
    """One request in flight: its jobs, output assembly and timing."""

    def __init__(self, endpoint: str, out: RequestOutput, jobs: list[GenerationJob], t0: float,
                 dispatcher: Dispatcher, metrics: RouterMetrics) -> None:
        self.endpoint, self.out, self.t0, self.metrics = endpoint, out, t0, metrics
        self.fan = Fanout(dispatcher, jobs)
        self._last: dict[int, float] = {}

    async def apply(self, item: Item) -> list[dict[str, Any]]:
        """Feed one event to its choice; returns the SSE chunks it produced."""
        i, event = item
        if isinstance(event, TokenEvent) and event.token_ids:
            now = time.monotonic()
            self.metrics.observe_tokens(self.endpoint, len(event.token_ids), now - self._last.get(i, now),
                                        i not in self._last, now - self.t0)
            self._last[i] = now
        delta = self.out.apply(i, event)
        if isinstance(event, TokenEvent) and self.out.choices[i].finished:
            await self.fan.cancel(i)  # the router hit a stop string: abort both legs now
        return self.out.chunks(i, delta)

    def done(self) -> None:
        self.metrics.observe_done(self.endpoint, time.monotonic() - self.t0, self.out.disaggregated,
                                  self.out.prompt_tokens, self.out.completion_tokens)

    async def collect(self) -> dict[str, Any]:
        while (item := await self.fan.next()) is not None:
            await self.apply(item)
        self.done()
        return self.out.response()

    async def events(self, first: Item | None) -> AsyncIterator[str]:
        shapes, item = self.out.shapes, first
        try:
            if shapes.chat:  # OpenAI opens every chat choice with its role
                for i in range(len(self.out.choices)):
                    yield _sse(shapes.chunk(i, "", role=True))
            while item is not None:
                for chunk in await self.apply(item):
                    yield _sse(chunk)
                item = await self.fan.next()
        except Exception as e:
            self.metrics.errors.labels(self.endpoint).inc()
            err = from_dispatch_error(e) if isinstance(e, DispatchError) else APIError(500, f"internal error: {e}")
            yield err.sse_event()
            yield _DONE
            return
        self.done()
        if shapes.include_usage:
            yield _sse(shapes.usage_chunk(self.out.usage()))
        yield _DONE


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def create_app(dispatcher: Dispatcher, tokenizer: Tokenizer, *, served_model: str,
               api_keys: set[str] | frozenset[str] = frozenset(), max_body_bytes: int = 1 << 20,
               max_queue: int = 256, metrics_registry: CollectorRegistry | None = None) -> FastAPI:
    """The OpenAI-compatible app; empty `api_keys` means no authentication; more than `max_queue`
    generation requests in flight are shed with 503 + Retry-After. `metrics_registry` lets the
    dispatcher's metrics appear on the same /metrics."""
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = RouterMetrics(metrics_registry)
    app.state.metrics = metrics
    install_handlers(app)
    app.add_middleware(ResponseCounter, metrics=metrics)
    keys = [k.encode() for k in api_keys]
    created_at = int(time.time())
    in_flight = 0

    def check_auth(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "You didn't provide an API key. Provide it in the Authorization header "
                                "as 'Bearer YOUR_KEY'.", code="invalid_api_key")
        # Compare with every key in constant time (a list, not a generator: no short-circuit), so
        # timing reveals neither which key matched nor a matching prefix.
        if not any([hmac.compare_digest(token.strip().encode(), k) for k in keys]):  # noqa: C419
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def parse(request: Request, schema: Any) -> Any:
        check_auth(request)
        body = await read_body(request, max_body_bytes)
        try:
            data = json.loads(body)
        except ValueError as e:  # UnicodeDecodeError is a ValueError too
            raise bad_request(f"We could not parse the JSON body of your request ({e}).", code="invalid_json") from e
        if not isinstance(data, dict):
            raise bad_request("The request body must be a JSON object.", code="invalid_json")
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            raise from_validation_error(e) from e
        if (why := req.unsupported()) is not None:
            raise bad_request(why[1], param=why[0], code="unsupported_parameter")
        if req.model != served_model:
            raise APIError(404, f"The model `{req.model}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        card = dispatcher.model()
        if card is None:
            raise APIError(503, "No node has reported its model yet; retry shortly.", code="model_not_ready",
                           retry_after_s=1.0)
        return req, card

    def choices(jobs: list[GenerationJob], card: ModelCard, req: Any, logprobs: bool) -> list[ChoiceText]:
        eos = frozenset() if req.ignore_eos else frozenset(card.eos_token_ids or tokenizer.eos_token_ids)
        return [ChoiceText(tokenizer, j.input_ids, stop=j.sampling.stop, logprobs=logprobs,
                           end_ids=eos | frozenset(j.sampling.stop_token_ids)) for j in jobs]

    async def serve(request: Request, endpoint: str, out: RequestOutput, jobs: list[GenerationJob],
                    stream: bool, t0: float) -> Response:
        nonlocal in_flight
        if in_flight >= max_queue:
            metrics.shed.inc()
            raise APIError(503, f"The router is at capacity ({max_queue} requests in flight); retry shortly.",
                           code="server_overloaded", retry_after_s=1.0)
        in_flight += 1
        metrics.in_flight.inc()
        run = _Serving(endpoint, out, jobs, t0, dispatcher, metrics)

        async def release() -> None:
            nonlocal in_flight
            await run.fan.close()
            in_flight -= 1
            metrics.in_flight.dec()

        handed_off = False
        try:
            run.fan.start()
            if not stream:
                body, gone = await _until_disconnect(request, run.collect())
                return Response(status_code=499) if gone else JSONResponse(body)
            first, gone = await _until_disconnect(request, run.fan.next())
            if gone:
                return Response(status_code=499)  # nobody listens; release() aborts the jobs
            handed_off = True
            return SSEResponse(run.events(first), cleanup=release)
        except DispatchError as e:
            raise from_dispatch_error(e) from e
        finally:
            if not handed_off:
                await release()

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        t0 = time.monotonic()
        req, card = await parse(request, CompletionRequest)
        prompts = req.prompts()
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise bad_request(f"'prompt' must hold 1 to {MAX_PROMPTS} prompts.", param="prompt",
                              code="empty_prompt" if not prompts else "invalid_value")
        rid = f"cmpl-{uuid.uuid4().hex}"
        top = req.logprobs  # None: no logprobs; 0..5: the chosen token's plus that many alternatives
        jobs: list[GenerationJob] = []
        prompt_tokens = 0
        for p in prompts:
            if p == "":  # it would still encode to [BOS]: refuse it as OpenAI-compatible servers do
                raise bad_request("'prompt' must not be empty.", param="prompt", code="empty_prompt")
            ids = tokenizer.encode(p) if isinstance(p, str) else list(p)
            check_ids(ids, tokenizer.vocab_size, "prompt")
            max_new = context_budget(len(ids), req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, card, "prompt")
            prompt_tokens += len(ids)  # once per prompt, not per choice, as OpenAI counts
            jobs += build_jobs(rid, len(prompts) * req.n, len(jobs), ids, req, max_new, top)
        out = RequestOutput(Shapes(False, rid, served_model, req.include_usage()),
                            choices(jobs, card, req, top is not None), prompt_tokens, top or 0, top is not None)
        return await serve(request, COMPLETIONS, out, jobs, bool(req.stream), t0)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        t0 = time.monotonic()
        req, card = await parse(request, ChatCompletionRequest)
        if not req.messages:
            raise bad_request("'messages' must hold at least one message.", param="messages", code="empty_messages")
        try:
            text = tokenizer.apply_chat_template([m.for_template() for m in req.messages], add_generation_prompt=True)
        except ChatTemplateError as e:
            raise bad_request(str(e), param="messages", code="invalid_messages") from e
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template rendered its own BOS
        check_ids(ids, tokenizer.vocab_size, "messages")
        max_new = context_budget(len(ids), req.max_new_tokens(), None, card, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        top = (req.top_logprobs or 0) if req.logprobs else None
        jobs = build_jobs(rid, req.n, 0, ids, req, max_new, top)
        out = RequestOutput(Shapes(True, rid, served_model, req.include_usage()),
                            choices(jobs, card, req, top is not None), len(ids), top or 0, top is not None)
        return await serve(request, CHAT, out, jobs, bool(req.stream), t0)

    def model_entry() -> dict[str, Any]:
        entry: dict[str, Any] = {"id": served_model, "object": "model", "created": created_at, "owned_by": "pdserve"}
        if (card := dispatcher.model()) is not None:
            entry["max_model_len"] = card.max_context_length
        return entry

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {"object": "list", "data": [model_entry()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> dict[str, Any]:
        check_auth(request)
        if model_id != served_model:
            raise APIError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        return model_entry()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}  # liveness only: the process answers

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = dispatcher.ready()
        return JSONResponse({"status": "ready" if ok else "not_ready"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.exposition()
        return Response(data, media_type=content_type)

    return app
