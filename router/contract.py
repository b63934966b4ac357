"""The contract between the router's HTTP side (OpenAI API) and its node side (pairs, gRPC).

The HTTP side turns a validated OpenAI request into a `GenerationJob` (token ids, sampling) and
consumes `TokenEvent`s then one `FinishEvent` from `Dispatcher.generate`. The node side picks a
(prefill, decode) pair, sends both legs, retries on a new pair only before the first event,
and raises `DispatchError` (with an HTTP status) when it cannot start or the stream breaks.
No torch anywhere in the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncGenerator, Protocol

from common.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationJob:
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool = True


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    matched_stop: int | str | None = None
    disaggregated: bool = True  # False when a colocated node served it
    cached_tokens: int = 0  # prompt tokens the node that ran the prompt found in its prefix cache


@dataclass
class DispatchError(Exception):
    """`status` is the HTTP status to report (503 no pair, 502 node failure, 429 shed, 400 bad)."""

    status: int
    message: str
    code: str = "node_error"
    retry_after_s: float | None = None
    before_first_token: bool = True

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ModelCard:
    """What /v1/models shows and what tokenization needs, from the nodes' GetModelInfo."""

    name: str
    tokenizer_path: str
    max_context_length: int
    eos_token_ids: tuple[int, ...] = field(default=())


class Dispatcher(Protocol):
    def generate(self, job: GenerationJob) -> AsyncGenerator[TokenEvent | FinishEvent, None]:
        """Events of one request; cancelling or closing the generator aborts both legs."""

    def model(self) -> ModelCard | None:
        """The served model, once some node answered GetModelInfo."""

    def ready(self) -> bool:
        """A compatible pair completed a real handoff recently (or a colocated node served)."""
