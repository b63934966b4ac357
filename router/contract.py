"""The contract between the router's HTTP side (OpenAI API) and its node side (pairs, gRPC).

The HTTP side turns a validated OpenAI request into a `GenerationJob` (token ids, sampling) and
consumes `TokenEvent`s then one `FinishEvent` from `Dispatcher.generate`. The node side picks a
(prefill, decode) pair, sends both legs, retries on a new pair only before the first event,
and raises `DispatchError` (with an HTTP status) when it cannot start or the stream breaks.
No torch anywhere in the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


@dataclass(frozen=True)
class SamplingSpec:
    """What the router asks a node for (mirrors the scheduler API's SamplingParams)."""

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True  # the nodes detokenize only to find stop strings
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)


@dataclass(frozen=True)
class GenerationJob:
    request_id: str
    input_ids: tuple[int, ...]
    sampling: SamplingSpec
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
    def generate(self, job: GenerationJob) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Events of one request; cancelling the iterator aborts both legs."""

    def model(self) -> ModelCard | None:
        """The served model, once some node answered GetModelInfo."""

    def ready(self) -> bool:
        """A compatible pair completed a real handoff recently (or a colocated node served)."""
