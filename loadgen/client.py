"""One streamed request to an OpenAI-compatible server, timed chunk by chunk (httpx, async).

Failures never raise: a refused connection, a non-200 status, an error event in the stream, a
timeout or a stream with no content all end up as `RequestRecord.error`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from loadgen.dataset import BenchRequest
from loadgen.metrics import RequestRecord

Clock = Callable[[], float]
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True  # a pdserve/vLLM/SGLang extension; strict servers may refuse it
    include_usage: bool = True
    temperature: float = 0.0
    timeout_s: float = 300.0  # whole request, first byte to last
    connect_timeout_s: float = 10.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {self.endpoint!r}")


def make_client(cfg: EndpointConfig, max_connections: int) -> httpx.AsyncClient:
    """The one connection pool every request of a run shares; all waits are bounded."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, timeout=timeout, limits=limits)


def request_body(
    cfg: EndpointConfig, prompt: str | list[int], max_tokens: int, messages: tuple[dict[str, str], ...] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": cfg.temperature,
    }
    if messages is not None:
        if cfg.endpoint != "chat":
            raise ValueError("a message list needs the chat endpoint")
        body["messages"] = [dict(m) for m in messages]
    elif cfg.endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("token-id prompts need the completions endpoint")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **cfg.extra_body}


async def served_model(client: httpx.AsyncClient) -> str:
    """The first model id of GET /v1/models (what `--model` defaults to)."""
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def send(
    client: httpx.AsyncClient, cfg: EndpointConfig, req: BenchRequest, t0: float, clock: Clock = time.perf_counter
) -> RequestRecord:
    """Send one streamed request; times are taken from `clock` (relative to the point's `t0`)."""
    rec = RequestRecord(req.index, req.input_len, req.output_len, reply="" if req.keep_reply else None)
    start = clock()
    rec.start = start - t0
    limit = cfg.timeout_s if req.timeout_s is None else req.timeout_s
    try:
        await asyncio.wait_for(_stream(client, cfg, req, rec, start, clock), limit)
    except asyncio.TimeoutError:
        rec.error = f"timeout after {limit:g} s"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    except (ValueError, KeyError, TypeError) as e:  # malformed JSON or a chunk of the wrong shape
        rec.error = f"bad stream: {type(e).__name__}: {e}"[:300]
    if rec.error is None and not rec.chunk_times:
        rec.error = "stream ended without any output"
    if rec.error is None and rec.output_tokens == 0:
        rec.output_tokens = len(rec.chunk_times)  # no usage: count one token per chunk
    return rec


async def _stream(
    client: httpx.AsyncClient, cfg: EndpointConfig, req: BenchRequest, rec: RequestRecord, start: float, clock: Clock
) -> None:
    body = request_body(cfg, req.prompt, req.output_len, req.messages)
    async with client.stream("POST", ENDPOINTS[cfg.endpoint], json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            rec.error = f"HTTP {resp.status_code}: {' '.join(text.split())[:200]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            if not _on_chunk(json.loads(payload), rec, clock() - start):
                return
    rec.e2e = clock() - start


def _on_chunk(chunk: dict[str, Any], rec: RequestRecord, now: float) -> bool:
    """Fold one SSE event into the record; False when it is an error event (stop reading)."""
    if chunk.get("error"):
        err = chunk["error"]
        rec.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        return False
    choices = chunk.get("choices") or ()
    if any(_content(choice) for choice in choices):
        if rec.ttft is None:
            rec.ttft = now
        rec.chunk_times.append(now)
        if rec.reply is not None:  # the answer only: reasoning is not sent back in the history
            rec.reply += "".join(str(c.get("text") or (c.get("delta") or {}).get("content") or "") for c in choices)
    usage = chunk.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        rec.cached_tokens = None if cached is None else int(cached)
    return True


def _content(choice: dict[str, Any]) -> str:
    """The text a chunk carries: `text` (completions) or the delta's content (chat); a role-only
    first chat delta carries none and does not count as the first token."""
    if choice.get("text"):
        return str(choice["text"])
    delta = choice.get("delta") or {}
    return str(delta.get("content") or delta.get("reasoning_content") or "")
