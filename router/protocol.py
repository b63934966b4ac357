"""OpenAI wire shapes: request schemas (pydantic, strict) and response/chunk builders.

Strict typing (no "0.5" -> 0.5 coercion) and `extra="forbid"` match what OpenAI answers with a 400.
Every documented OpenAI field is declared, even the ones the router does not act on, so a client
written against the real API is never refused for sending them; the ones that would change the
output in a way we cannot honour (suffix, the legacy functions, audio, ...) are refused explicitly
in `unsupported()`, never silently dropped. `response_format` and the structured-output extensions
become a grammar constraint (router/structured.py), `tools` a parser and maybe one
(router/tools/).

The extensions vLLM and SGLang clients send are declared too (router/extensions.py says which are
honoured, which change nothing here, and which are refused and why).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.sampling import Constraint, SamplingParams
from router.contract import GenerationJob, ModelCard
from router.errors import APIError, bad_request
from router.extensions import ChatExtensions, SamplingExtensions
from router.request_id import node_request_id_of, request_id_of

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions `logprobs`
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`
MAX_LOGIT_BIAS = 1024  # tokens one request may bias

_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI field; there is nothing to obfuscate here


class _Sampling(SamplingExtensions):
    """Fields shared by both endpoints."""

    model_config = _STRICT

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None  # router/structured.py reads it

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        if v is not None and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(b)) for k, b in (self.logit_bias or {}).items()))

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_spec(
        self, max_new_tokens: int, choice: int, top_logprobs: int | None, constraint: Constraint | None = None
    ) -> SamplingParams:
        """The node-side sampling of choice `choice`; `top_logprobs` None means no logprobs."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k else -1,  # 0 and -1 both mean "off"
            min_p=self.min_p or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop_list(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            # One seed for n separate jobs would make the n choices identical: choice j gets seed + j.
            seed=None if self.seed is None else self.seed + choice,
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.bias_pairs(),
            constraint=constraint,
        )

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for a field whose value we cannot honour, else None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return self.refused_extension()


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, a list of strings, one id list or a list of id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        # the rest is all strings or all id lists (validation refuses a mix): the filter drops nothing
        return [x for x in p if not isinstance(x, int)]

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo and self.logprobs is not None:
            return "echo", (
                "echo with logprobs needs the prompt's logprobs, which the nodes do not compute; use one or the other"
            )
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is supported only when equal to n"
        return super().unsupported()


class ChatCompletionRequest(ChatExtensions, _Sampling):
    messages: list[Any]  # checked as OpenAI does, with exact params, by router.messages
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    # Declared so clients may send them; see unsupported() for which values are refused.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # Accepted and ignored: they do not change the tokens a model produces here.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None

    def max_new_tokens(self) -> int | None:
        # max_completion_tokens is the current name; max_tokens the deprecated one.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        if self.functions or self.function_call not in (None, "none"):
            legacy = "functions" if self.functions else "function_call"
            return legacy, f"the legacy '{legacy}' is not supported: use 'tools' and 'tool_choice'"
        if self.modalities and self.modalities != ["text"]:
            return "modalities", "only the text modality is supported"
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(self, name):
                return name, f"{name} is not supported"
        return self.refused_chat_extension() or super().unsupported()


class Shapes:
    """Response, choice and SSE chunk dicts of one request, exactly in OpenAI's shapes."""

    def __init__(self, chat: bool, rid: str, model: str, include_usage: bool = False) -> None:
        self.chat, self.rid, self.model, self.include_usage = chat, rid, model, include_usage
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def response(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": choices, "usage": usage}

    def choice(
        self,
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if tool_calls:  # OpenAI: null content beside tool calls when the model said nothing
                message.update(content=text or None, tool_calls=tool_calls)
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk(
        self,
        index: int,
        text: str | None = None,
        logprobs: dict[str, Any] | None = None,
        finish: str | None = None,
        role: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        # With include_usage, OpenAI sends "usage": null on every chunk but the last one.
        return {**head, "choices": [choice], **({"usage": None} if self.include_usage else {})}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def check_bias_ids(pairs: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    for token, _ in pairs:
        if token >= vocab_size:
            raise bad_request(
                f"Invalid key in 'logit_bias': {token}. Token ids must be in [0, {vocab_size}).",
                param="logit_bias",
                code="invalid_value",
            )


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    if not ids:
        raise bad_request(f"'{param}' must not be empty.", param=param, code="empty_prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:  # C loops: a long history checks in tens of microseconds
        raise bad_request(f"Token ids must be in [0, {vocab_size}).", param=param, code="invalid_token_id")


def context_budget(n_prompt: int, asked: int | None, default: int | None, card: ModelCard, param: str) -> int:
    """max_new_tokens for a prompt; 400 context_length_exceeded when prompt + completion do not fit."""
    room = card.max_context_length - n_prompt
    max_new = asked if asked is not None else (min(default, room) if default else room)
    if room < 1 or n_prompt + max_new > card.max_context_length:
        want = max(max_new, 1)
        raise bad_request(
            f"This model's maximum context length is {card.max_context_length} tokens. However, you requested "
            f"{n_prompt + want} tokens ({n_prompt} in the {param}, {want} in the completion). Please reduce "
            f"the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return max_new


def check_min_tokens(min_tokens: int, max_new: int, asked: bool) -> None:
    """min_tokens may not exceed what the request may generate (max_tokens, else the context left)."""
    if min_tokens > max_new:
        limit = f"max_tokens ({max_new})" if asked else f"the {max_new} tokens left in the context"
        raise bad_request(
            f"min_tokens ({min_tokens}) must be at most {limit}.", param="min_tokens", code="invalid_value"
        )


def truncate(ids: list[int], keep: int | None, card: ModelCard) -> list[int]:
    """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context holds)."""
    if keep is None:
        return ids
    k = card.max_context_length if keep == -1 else keep
    return ids[-k:] if k < len(ids) else ids


def response_ids(prefix: str, client_id: str | None, request: Request) -> tuple[str, str]:
    """(the response's id, the base of its node-side request ids). A body request_id names the
    response (as vLLM does), else the request's id (X-Request-Id); node-side ids stay unique among
    the requests in flight even when a client reuses its ids (router/request_id.py)."""
    return f"{prefix}-{client_id or request_id_of(request)}", node_request_id_of(request)


def build_jobs(
    rid: str,
    total: int,
    start: int,
    ids: list[int],
    req: Any,
    max_new: int,
    top_logprobs: int | None,
    constraint: Constraint | None = None,
) -> list[GenerationJob]:
    """The n jobs of one prompt; choice index = prompt index * n + j, as OpenAI numbers them."""
    return [
        GenerationJob(
            request_id=rid if total == 1 else f"{rid}-{start + j}",
            input_ids=tuple(ids),
            sampling=req.sampling_spec(max_new, j, top_logprobs, constraint),
            stream=bool(req.stream),
        )
        for j in range(req.n)
    ]


async def read_body(request: Request, limit: int) -> bytes:
    """The body; 413 past `limit`, without reading it when Content-Length already says so."""
    too_big = APIError(413, f"The request body is larger than the {limit} bytes allowed.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # chunked uploads declare no length
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)
