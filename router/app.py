"""The router's HTTP side: `RouterApp`, OpenAI /v1/completions and /v1/chat/completions over a `Dispatcher`.

A request is authenticated, size-checked, parsed and validated (400s in OpenAI's shape), tokenized
here (the router owns text), turned into one `GenerationJob` per choice (with the request's grammar
constraint, if any) and fanned out to the dispatcher; with tools, a parser per choice turns its
text into content and tool calls. A stream is held back until its first event arrives, so a dispatch failure before it
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
from typing import Any, Collection, TypeVar

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
from router.prefix_tokens import MAX_BYTES as PREFIX_TOKEN_BYTES
from router.prefix_tokens import PrefixTokenCache, PrefixTokenCollector
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
from router.structured import request_constraints, single
from router.text import ChoiceText, RequestOutput, TextOptions
from router.tools.plan import plan_chat
from router.tools.registry import resolve

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_PROMPTS = 64  # prompts in one batched completions request
DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy endpoint's documented default
MAX_BODY_BYTES = 1 << 20
# How a client's leaving is told in the log, by the stage it left at (the disconnect metric's label).
_LEFT = {
    "body": "while sending its request body",
    "before_first_token": "before its first token",
    "streaming": "mid-stream",
}

OpenAIRequest = TypeVar("OpenAIRequest", CompletionRequest, ChatCompletionRequest)


class RouterApp:
    """The OpenAI-compatible app (`.app`) over a dispatcher. Empty `api_keys` means no authentication;
    more than `max_queue` generation requests in flight are shed with 503 + Retry-After;
    `metrics_registry` lets the dispatcher's metrics appear on the same /metrics; `tool_call_parser`
    names the model's tool-call format (None: the one its chat template shows, if any)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        *,
        served_model: str,
        api_keys: Collection[str] = frozenset(),
        max_body_bytes: int = MAX_BODY_BYTES,
        max_queue: int = DEFAULT_MAX_QUEUE,
        metrics_registry: CollectorRegistry | None = None,
        tool_call_parser: str | None = None,
        prefix_token_bytes: int = PREFIX_TOKEN_BYTES,
    ) -> None:
        self.dispatcher, self.tokenizer, self.served_model = dispatcher, tokenizer, served_model
        self.tool_parser = resolve(tool_call_parser, tokenizer.chat_template_sources)
        self.max_body_bytes, self.max_queue = max_body_bytes, max_queue
        self.metrics = RouterMetrics(metrics_registry)
        self.prefix_tokens = PrefixTokenCache(tokenizer, prefix_token_bytes)  # a next turn encodes only what is new
        self.metrics.registry.register(PrefixTokenCollector(self.prefix_tokens))
        self.keys = [k.encode() for k in api_keys]
        self.created_at = int(time.time())
        self.in_flight = 0  # generation requests admitted and not yet released
        self.app = self._build()

    def _build(self) -> FastAPI:
        """The FastAPI app: error handlers, middleware, and one route per method below."""
        app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
        install_handlers(app)
        app.add_exception_handler(ClientDisconnect, self._body_disconnect)
        app.add_middleware(ResponseCounter, metrics=self.metrics)
        app.add_middleware(RequestIdMiddleware)  # outermost: its header is on every response it sees
        app.add_api_route(COMPLETIONS, self.completions, methods=["POST"])
        app.add_api_route(CHAT, self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ready", self.ready, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        return app

    # ---- generation routes ----

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions: one job per prompt and choice."""
        t0 = time.monotonic()
        req, card = await self._parse(request, CompletionRequest)
        prompts = req.prompts()
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise bad_request(
                f"'prompt' must hold 1 to {MAX_PROMPTS} prompts.",
                param="prompt",
                code="empty_prompt" if not prompts else "invalid_value",
            )
        rid, job_rid = response_ids("cmpl", req.client_request_id(), request)
        top = req.logprobs  # None: no logprobs; 0..5: the chosen token's plus that many alternatives
        constraint = single(request_constraints(req))
        jobs: list[GenerationJob] = []
        echoes: list[str] = []
        prompt_tokens = 0
        for p in prompts:
            if p == "":  # it would still encode to [BOS]: refuse it as OpenAI-compatible servers do
                raise bad_request("'prompt' must not be empty.", param="prompt", code="empty_prompt")
            ids = self._prompt_ids(p, req, card, "prompt", req.add_special_tokens is not False)
            max_new = _budget(len(ids), req, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, card, "prompt")
            prompt_tokens += len(ids)  # once per prompt, not per choice, as OpenAI counts
            jobs += build_jobs(job_rid, len(prompts) * req.n, len(jobs), ids, req, max_new, top, constraint)
            # echo: the prompt as sent, or as the model saw it when given as ids or truncated
            echo = (
                p
                if isinstance(p, str) and req.truncate_prompt_tokens is None
                else self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
            )
            echoes += [echo if req.echo else ""] * req.n
        out = RequestOutput(
            Shapes(False, rid, self.served_model, req.include_usage()),
            self._choices(jobs, card, req, top is not None, echoes, req.skip_special_tokens),
            prompt_tokens,
            top or 0,
            top is not None,
            choices_per_prompt=req.n,
        )
        return await self._serve(request, COMPLETIONS, out, jobs, bool(req.stream), t0)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions: the messages rendered by the chat template, one job per choice."""
        t0 = time.monotonic()
        req, card = await self._parse(request, ChatCompletionRequest)
        tools, constraint = plan_chat(req, self.tool_parser, self.tokenizer.token_to_id)
        text, echo = render_chat(self.tokenizer, req, tools.template_tools)
        # the template renders its own BOS: nothing is added unless the client asks (vLLM's default)
        ids = self._prompt_ids(text, req, card, "messages", bool(req.add_special_tokens))
        max_new = _budget(len(ids), req, req.max_new_tokens(), None, card, "messages")
        rid, job_rid = response_ids("chatcmpl", req.client_request_id(), request)
        top = (req.top_logprobs or 0) if req.logprobs else None
        jobs = build_jobs(job_rid, req.n, 0, ids, req, max_new, top, constraint)
        skip_special = tools.skip_special_tokens(req.skip_special_tokens)
        out = RequestOutput(
            Shapes(True, rid, self.served_model, req.include_usage()),
            self._choices(jobs, card, req, top is not None, [echo] * len(jobs), skip_special),
            len(ids),
            top or 0,
            top is not None,
            choices_per_prompt=req.n,
            parsers=tools.parsers(len(jobs)),
        )
        return await self._serve(request, CHAT, out, jobs, bool(req.stream), t0)

    # ---- a generation request, step by step ----

    async def _parse(self, request: Request, schema: type[OpenAIRequest]) -> tuple[OpenAIRequest, ModelCard]:
        """The authenticated, validated request and the served model's card; APIError otherwise."""
        self._check_auth(request)
        body = await read_body(request, self.max_body_bytes)
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
        check_bias_ids(req.bias_pairs(), self.tokenizer.vocab_size)
        if req.model != self.served_model:
            raise _unknown_model(req.model)
        card = self.dispatcher.model()
        if card is None:
            raise APIError(
                503, "No node has reported its model yet; retry shortly.", code="model_not_ready", retry_after_s=1.0
            )
        return req, card

    def _prompt_ids(
        self, prompt: str | list[int], req: OpenAIRequest, card: ModelCard, param: str, add_special: bool
    ) -> list[int]:
        """The prompt's token ids, truncated as asked and checked against the vocabulary."""
        if isinstance(prompt, str):
            ids = self.prefix_tokens.encode(prompt, add_special)
        else:
            ids = list(prompt)
        ids = truncate(ids, req.truncate_prompt_tokens, card)
        check_ids(ids, self.tokenizer.vocab_size, param)
        return ids

    def _choices(
        self,
        jobs: list[GenerationJob],
        card: ModelCard,
        req: OpenAIRequest,
        logprobs: bool,
        echoes: list[str],
        skip_special: bool,
    ) -> list[ChoiceText]:
        """One text assembler per job: its stops, end ids, echo and special tokens shown or not."""
        eos = frozenset() if req.ignore_eos else frozenset(card.eos_token_ids or self.tokenizer.eos_token_ids)
        return [
            ChoiceText(
                self.tokenizer,
                j.input_ids,
                stop=j.sampling.stop,
                logprobs=logprobs,
                end_ids=eos | frozenset(j.sampling.stop_token_ids),
                options=TextOptions(skip_special, req.include_stop_str(), req.min_tokens, echo),
            )
            for j, echo in zip(jobs, echoes)
        ]

    async def _serve(
        self, request: Request, endpoint: str, out: RequestOutput, jobs: list[GenerationJob], stream: bool, t0: float
    ) -> Response:
        """Admit the request, run its jobs and answer: JSON once done, or an SSE stream once its first
        event is in. Jobs are released (aborted if unfinished) when the answer is complete or the
        client left; a stream releases them itself when it ends."""
        self._admit()
        run = Serving(endpoint, out, jobs, t0, self.dispatcher, self.metrics)
        handed_off = False
        try:
            run.fan.start()
            if not stream:
                result, gone = await until_disconnect(request, run.collect())
                return self._left_before_first_token(request) if gone else JSONResponse(result)
            first, gone = await until_disconnect(request, run.fan.next())
            if gone:
                return self._left_before_first_token(request)
            handed_off = True
            return SSEResponse(
                run.events(first),
                cleanup=lambda: self._release(run),
                on_disconnect=lambda: self._client_left("streaming", request),
            )
        except DispatchError as e:
            raise from_dispatch_error(e) from e
        finally:
            if not handed_off:
                await self._release(run)

    def _admit(self) -> None:
        """Count the request in flight, or shed it with 503 when `max_queue` already are."""
        if self.in_flight >= self.max_queue:
            self.metrics.shed.inc()
            raise APIError(
                503,
                f"The router is at capacity ({self.max_queue} requests in flight); retry shortly.",
                code="server_overloaded",
                retry_after_s=1.0,
            )
        self.in_flight += 1
        self.metrics.in_flight.inc()

    async def _release(self, run: Serving) -> None:
        """The request is over: its jobs closed (which aborts unfinished ones), its slot freed."""
        await run.fan.close()
        self.in_flight -= 1
        self.metrics.in_flight.dec()

    # ---- clients: keys and leaving ----

    def _check_auth(self, request: Request) -> None:
        """401 unless the request carries one of the keys (when there are keys)."""
        if not self.keys:
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
        if not any([hmac.compare_digest(token.strip().encode(), k) for k in self.keys]):  # noqa: C419
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def _client_left(self, stage: str, request: Request) -> None:
        """Count a client that hung up at `stage` and log it: a line, never a traceback (clients hang up
        all the time: timeouts, cancelled tools)."""
        self.metrics.client_disconnects.labels(stage).inc()
        log.log(
            logging.INFO if stage == "body" else logging.DEBUG,
            "client disconnected %s: %s %s",
            _LEFT[stage],
            request.method,
            request.url.path,
        )

    def _left_before_first_token(self, request: Request) -> Response:
        """Nobody listens any more; the caller's release aborts the jobs."""
        self._client_left("before_first_token", request)
        return Response(status_code=499)

    async def _body_disconnect(self, request: Request, _: Exception) -> Response:
        """ClientDisconnect's handler: the only place the app reads from the client is the body."""
        self._client_left("body", request)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    # ---- models, probes, metrics ----

    def _model_entry(self) -> dict[str, Any]:
        """The served model as /v1/models lists it, with its context length once a node reported it."""
        entry: dict[str, Any] = {
            "id": self.served_model,
            "object": "model",
            "created": self.created_at,
            "owned_by": "pdserve",
        }
        if (card := self.dispatcher.model()) is not None:
            entry["max_model_len"] = card.max_context_length
        return entry

    async def list_models(self, request: Request) -> dict[str, Any]:
        self._check_auth(request)
        return {"object": "list", "data": [self._model_entry()]}

    async def get_model(self, request: Request, model_id: str) -> dict[str, Any]:
        self._check_auth(request)
        if model_id != self.served_model:
            raise _unknown_model(model_id)
        return self._model_entry()

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}  # liveness only: the process answers

    async def ready(self) -> JSONResponse:
        ok = self.dispatcher.ready()
        return JSONResponse({"status": "ready" if ok else "not_ready"}, status_code=200 if ok else 503)

    async def prometheus(self) -> Response:
        data, content_type = self.metrics.exposition()
        return Response(data, media_type=content_type)


def _budget(
    n_prompt: int, req: OpenAIRequest, asked: int | None, default: int | None, card: ModelCard, param: str
) -> int:
    """The most new tokens the context leaves (400 when the prompt or min_tokens does not fit)."""
    max_new = context_budget(n_prompt, asked, default, card, param)
    check_min_tokens(req.min_tokens, max_new, asked is not None)
    return max_new


def _unknown_model(model: str) -> APIError:
    """OpenAI's 404 for a model id other than the one served."""
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )
