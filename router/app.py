"""The router's HTTP side: OpenAI /v1/completions and /v1/chat/completions over a `Dispatcher`.

A request is authenticated, size-checked, parsed and validated (400s in OpenAI's shape), tokenized
here (the router owns text), turned into one `GenerationJob` per choice and fanned out to the
dispatcher. A stream is held back until its first event arrives, so a dispatch failure before it
still gets a real HTTP status; after it, errors become an SSE error event followed by [DONE]. A
client that goes away (stream or not) cancels the dispatcher iterators, which aborts both legs; a
disconnect is one log line and a count by stage (while its body was read, before the first token,
mid-stream), never a traceback or a 500.

finish_reason "abort" (a node gave the request up) is passed through as is: the openai client
parses it (its models are built without validation), and mapping it to "stop" would present a
truncated answer as complete.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from common.defaults import DEFAULT_MAX_QUEUE
from common.tokenizer import Tokenizer
from router.chat import render as render_chat
from router.contract import Dispatcher, DispatchError, GenerationJob, ModelCard
from router.errors import APIError, bad_request, from_dispatch_error, from_validation_error, install_handlers
from router.metrics import ResponseCounter, RouterMetrics
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Shapes,
    build_jobs,
    check_bias_ids,
    check_ids,
    check_min_tokens,
    context_budget,
    read_body,
    response_ids,
    truncate,
)
from router.request_id import RequestIdMiddleware
from router.serving import Serving, SSEResponse, until_disconnect
from router.text import ChoiceText, RequestOutput, TextOptions

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_PROMPTS = 64  # prompts in one batched completions request
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy endpoint's documented default


def create_app(
    dispatcher: Dispatcher,
    tokenizer: Tokenizer,
    *,
    served_model: str,
    api_keys: set[str] | frozenset[str] = frozenset(),
    max_body_bytes: int = 1 << 20,
    max_queue: int = DEFAULT_MAX_QUEUE,
    metrics_registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The OpenAI-compatible app; empty `api_keys` means no authentication; more than `max_queue`
    generation requests in flight are shed with 503 + Retry-After. `metrics_registry` lets the
    dispatcher's metrics appear on the same /metrics."""
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = RouterMetrics(metrics_registry)
    app.state.metrics = metrics
    install_handlers(app)
    app.add_middleware(ResponseCounter, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost: its header is on every response it sees
    keys = [k.encode() for k in api_keys]
    created_at = int(time.time())
    in_flight = 0

    def client_left(stage: str, request: Request) -> None:
        # Clients hang up all the time (timeouts, cancelled tools): a count and a line, no traceback.
        metrics.client_disconnects.labels(stage).inc()
        log.log(
            logging.INFO if stage == "body" else logging.DEBUG,
            "client disconnected %s: %s %s",
            {
                "body": "while sending its request body",
                "before_first_token": "before its first token",
                "streaming": "mid-stream",
            }[stage],
            request.method,
            request.url.path,
        )

    @app.exception_handler(ClientDisconnect)
    async def _body_disconnect(request: Request, _: ClientDisconnect) -> Response:
        client_left("body", request)  # the only place the app reads from the client is the body
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    def check_auth(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'.",
                code="invalid_api_key",
            )
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
        check_bias_ids(req.bias_pairs(), tokenizer.vocab_size)
        if req.model != served_model:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        card = dispatcher.model()
        if card is None:
            raise APIError(
                503, "No node has reported its model yet; retry shortly.", code="model_not_ready", retry_after_s=1.0
            )
        return req, card

    def choices(
        jobs: list[GenerationJob], card: ModelCard, req: Any, logprobs: bool, echoes: list[str]
    ) -> list[ChoiceText]:
        eos = frozenset() if req.ignore_eos else frozenset(card.eos_token_ids or tokenizer.eos_token_ids)
        return [
            ChoiceText(
                tokenizer,
                j.input_ids,
                stop=j.sampling.stop,
                logprobs=logprobs,
                end_ids=eos | frozenset(j.sampling.stop_token_ids),
                options=TextOptions(req.skip_special_tokens, req.include_stop_str(), req.min_tokens, echo),
            )
            for j, echo in zip(jobs, echoes)
        ]

    def prompt_ids(prompt: str | list[int], req: Any, card: ModelCard, param: str, add_special: bool) -> list[int]:
        ids = tokenizer.encode(prompt, add_special_tokens=add_special) if isinstance(prompt, str) else list(prompt)
        ids = truncate(ids, req.truncate_prompt_tokens, card)
        check_ids(ids, tokenizer.vocab_size, param)
        return ids

    def budget(n_prompt: int, req: Any, asked: int | None, default: int | None, card: ModelCard, param: str) -> int:
        max_new = context_budget(n_prompt, asked, default, card, param)
        check_min_tokens(req.min_tokens, max_new, asked is not None)
        return max_new

    async def serve(
        request: Request, endpoint: str, out: RequestOutput, jobs: list[GenerationJob], stream: bool, t0: float
    ) -> Response:
        nonlocal in_flight
        if in_flight >= max_queue:
            metrics.shed.inc()
            raise APIError(
                503,
                f"The router is at capacity ({max_queue} requests in flight); retry shortly.",
                code="server_overloaded",
                retry_after_s=1.0,
            )
        in_flight += 1
        metrics.in_flight.inc()
        run = Serving(endpoint, out, jobs, t0, dispatcher, metrics)

        async def release() -> None:
            nonlocal in_flight
            await run.fan.close()
            in_flight -= 1
            metrics.in_flight.dec()

        handed_off = False
        try:
            run.fan.start()
            work = run.collect() if not stream else run.fan.next()
            result, gone = await until_disconnect(request, work)
            if gone:  # nobody listens; release() aborts the jobs
                client_left("before_first_token", request)
                return Response(status_code=499)
            if not stream:
                return JSONResponse(result)
            handed_off = True
            return SSEResponse(
                run.events(result), cleanup=release, on_disconnect=lambda: client_left("streaming", request)
            )
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
            raise bad_request(
                f"'prompt' must hold 1 to {MAX_PROMPTS} prompts.",
                param="prompt",
                code="empty_prompt" if not prompts else "invalid_value",
            )
        rid, job_rid = response_ids("cmpl", req.client_request_id(), request)
        top = req.logprobs  # None: no logprobs; 0..5: the chosen token's plus that many alternatives
        jobs: list[GenerationJob] = []
        echoes: list[str] = []
        prompt_tokens = 0
        for p in prompts:
            if p == "":  # it would still encode to [BOS]: refuse it as OpenAI-compatible servers do
                raise bad_request("'prompt' must not be empty.", param="prompt", code="empty_prompt")
            ids = prompt_ids(p, req, card, "prompt", req.add_special_tokens is not False)
            max_new = budget(len(ids), req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, card, "prompt")
            prompt_tokens += len(ids)  # once per prompt, not per choice, as OpenAI counts
            jobs += build_jobs(job_rid, len(prompts) * req.n, len(jobs), ids, req, max_new, top)
            # echo: the prompt as sent, or as the model saw it when given as ids or truncated
            echo = (
                p
                if isinstance(p, str) and req.truncate_prompt_tokens is None
                else tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
            )
            echoes += [echo if req.echo else ""] * req.n
        out = RequestOutput(
            Shapes(False, rid, served_model, req.include_usage()),
            choices(jobs, card, req, top is not None, echoes),
            prompt_tokens,
            top or 0,
            top is not None,
        )
        return await serve(request, COMPLETIONS, out, jobs, bool(req.stream), t0)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        t0 = time.monotonic()
        req, card = await parse(request, ChatCompletionRequest)
        text, echo = render_chat(tokenizer, req)
        # the template renders its own BOS: nothing is added unless the client asks (vLLM's default)
        ids = prompt_ids(text, req, card, "messages", bool(req.add_special_tokens))
        max_new = budget(len(ids), req, req.max_new_tokens(), None, card, "messages")
        rid, job_rid = response_ids("chatcmpl", req.client_request_id(), request)
        top = (req.top_logprobs or 0) if req.logprobs else None
        jobs = build_jobs(job_rid, req.n, 0, ids, req, max_new, top)
        out = RequestOutput(
            Shapes(True, rid, served_model, req.include_usage()),
            choices(jobs, card, req, top is not None, [echo] * len(jobs)),
            len(ids),
            top or 0,
            top is not None,
        )
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
            raise APIError(
                404,
                f"The model `{model_id}` does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
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
