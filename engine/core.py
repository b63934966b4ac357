"""The engine's vocabulary: sampling parameters, requests, batches and forward modes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from common.sampling import InvalidRequest
from common.sampling import SamplingParams as SamplingSchema

if TYPE_CHECKING:
    from engine.grammar.base import GrammarMatcher


class ForwardMode(enum.IntEnum):
    """What a forward pass computes; attention backends and runners branch on this, not on flags."""

    EXTEND = 1  # prompt (or a chunk of it) with an optional cached prefix
    DECODE = 2  # one new token per request
    TARGET_VERIFY = 3  # a fixed number of draft tokens per request, checked by the target
    DRAFT_EXTEND = 4  # the draft model over tokens the target just accepted
    PREBUILT = 5  # KV arrived from a prefill node; nothing to compute
    IDLE = 6  # nothing to run
    # decoding requests' next tokens and a prompt chunk in one forward (a decode node running a
    # prompt itself): its leading `Batch.decode_rows` rows take their input from the FutureMap;
    # it runs as an EXTEND forward whose first rows attend like DECODE ones
    MIXED = 7

    def is_extend_like(self) -> bool:
        """Modes whose requests contribute a variable or multi-token query window."""
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.MIXED)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # cancelled by the client or failed


@dataclass(frozen=True, slots=True)
class SamplingParams(SamplingSchema):
    """The shared sampling schema, validated at construction: a bad field raises InvalidRequest."""

    def __post_init__(self) -> None:
        self.check()


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued, no KV
    RUNNING = "running"  # has KV, decoding (or mid chunked prefill)
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    """One generation request and its KV bookkeeping.

    `seq_len` counts tokens whose KV is written. After the prompt is prefilled and the first
    token sampled, `seq_len == len(prompt)`: the newest output token has no KV yet; it is the
    next step's input (and, under speculation, the root of the next verify).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    slot: int = 0  # row in the request table; 0 means "none" (row 0 is padding)
    seq_len: int = 0  # tokens with committed KV
    num_pages: int = 0  # pages allocated for this request
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    sampling_seed: int = 0  # concrete seed (params.seed or one drawn at submission)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_retractions: int = 0
    solo: int = 0  # steps left to run alone (a batch it was in failed: find out whether it is the cause)
    queued_at: float = 0.0  # time.monotonic() when it (re)entered the waiting queue
    admitted_at: float = 0.0  # time.monotonic() of its first admission to a batch
    spec_state: Any = None  # opaque per-request state owned by a speculative worker
    handoff: Any = None  # PD decode: the algorithm's handoff state, decoded by its codec
    # PD prefill: keep KV pages and speculative state after finishing, until the transfer ends
    hold_kv: bool = False
    # Overlap scheduling: what launched-but-uncollected batches will add. The host knows them
    # only as counts: `inflight_len` KV tokens (exact for extend and plain decode, an upper
    # bound under speculation) and `inflight_samples` batches that emit tokens it has not seen.
    inflight: int = 0  # launched batches holding this request, not yet collected
    inflight_len: int = 0
    inflight_samples: int = 0
    epoch: int = 0  # bumped on retraction / finish: results launched before are discarded
    release_pending: bool = False  # KV and slot go back once the last in-flight batch is collected
    cached_tokens: int = 0  # prompt tokens its last admission found in the prefix cache
    # params.constraint's matcher, built before the request enters the scheduler; it has taken
    # exactly the tokens in output_ids (the scheduler advances it as tokens are appended)
    grammar: "GrammarMatcher | None" = None

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without concatenating the whole sequence."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def sched_len(self) -> int:
        """KV tokens written once every launched batch ran (an upper bound under speculation)."""
        return self.seq_len + self.inflight_len

    @property
    def num_uncomputed(self) -> int:
        """Tokens of prompt + output whose KV is not written or being written yet."""
        return self.total_len - self.sched_len

    @property
    def is_decoding(self) -> bool:
        """Prompt fully in KV (or being written) and a sampled token (maybe still on the device)
        waiting to be fed back."""
        if self.inflight_samples:
            return True
        return bool(self.output_ids) and self.sched_len == self.total_len - 1

    @property
    def needs_extend(self) -> bool:
        """Part of prompt + output still has to be prefilled (fresh, chunked or retracted)."""
        return not self.inflight_samples and (self.num_uncomputed > 1 or not self.output_ids)

    @property
    def will_finish(self) -> bool:
        """Tokens already being sampled certainly reach the length limit (no decode needed)."""
        return len(self.output_ids) + self.inflight_samples >= self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    @property
    def live_grammar(self) -> "GrammarMatcher | None":
        """The matcher masks are built from: none once the request finished (an overlapped batch
        may still carry it; what it computes for it is discarded)."""
        return None if self.finished else self.grammar

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def finish(self, reason: FinishReason, detail: str = "") -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_detail = detail
        self.state = ReqState.FINISHED


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How one decode batch runs, chosen when the batch is formed (`Executor.plan_decode`) and
    carried with it, so the step that runs is the step that was chosen: the KV slots each request
    may write beyond its length (what the scheduler reserves), the draft step count (0: plain),
    and the worker's own runtime state for that count (widths, graph set; opaque to the engine)."""

    window: int = 1
    steps: int = 0
    state: Any = None


PLAIN_DECODE = DecodePlan()  # one token per request, nothing drafted


@dataclass(slots=True)
class Batch:
    """Requests that run one forward together, with the mode and per-request query lengths.

    Request i computes tokens [seq_len, seq_len + extend_lens[i]) of its prompt + output; it
    samples a new token only when that window reaches the end of what is known (`sample[i]`).
    DECODE is the special case of one token per request. After a retraction a request simply
    extends over prompt + output again.
    """

    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    # KV tokens before this batch's window per request, as the host knows them at launch:
    # exact for extend and plain decode, an upper bound for a speculative decode (the exact
    # value is on the device). Filled from `Req.sched_len` when the batch is formed.
    prefix_lens: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # Req.epoch at launch
    # DECODE: how it runs (the executor's plan for this batch's size and context room)
    plan: DecodePlan = PLAIN_DECODE
    # MIXED: the leading rows that are plain decode steps (one token each, input on the device)
    decode_rows: int = 0
    # Set by an overlapping scheduler when the batch in flight samples for a constrained request:
    # it collects that batch, so every matcher holds every earlier token. An executor that
    # settles grammars in its launch calls it (`settle_grammar`) after enqueuing the forward and
    # before reading any matcher, so the host's collect hides behind the device's forward.
    settle: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not self.prefix_lens:
            self.prefix_lens = [r.sched_len for r in self.reqs]

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def settle_grammar(self) -> None:
        """Before reading a matcher: bring the batch in flight's tokens into them (if needed)."""
        if self.settle is not None:
            self.settle()

    @property
    def window(self) -> int:
        """DECODE: KV slots one request may write beyond its committed length this step."""
        return self.plan.window

    @staticmethod
    def decode(reqs: list[Req], plan: DecodePlan = PLAIN_DECODE) -> "Batch":
        return Batch(ForwardMode.DECODE, reqs, [1] * len(reqs), [True] * len(reqs), plan=plan)

    @staticmethod
    def mixed(decode: "Batch", chunk: "Batch") -> "Batch":
        """A plain decode step and a prompt chunk as one forward (decode rows first)."""
        return Batch(
            ForwardMode.MIXED,
            decode.reqs + chunk.reqs,
            decode.extend_lens + chunk.extend_lens,
            decode.sample + chunk.sample,
            decode_rows=len(decode.reqs),
        )

    @property
    def prompt_tokens(self) -> int:
        """Prompt (or re-extended) tokens the batch computes: a MIXED batch's decode rows aside."""
        if self.mode is ForwardMode.EXTEND:
            return self.num_tokens
        return sum(self.extend_lens[self.decode_rows :]) if self.mode is ForwardMode.MIXED else 0

    @staticmethod
    def idle() -> "Batch":
        return Batch(ForwardMode.IDLE, [])


@dataclass(slots=True)
class StepOutput:
    """What one executor step produced, on the CPU: new tokens per request (several under
    speculation), with optional logprobs. `tokens[i]` is empty for a non-final prefill chunk.
    `tokens[i]` may run past a stop: the scheduler cuts it."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    accepted_drafts: list[int] | None = None  # speculative: correct drafts per request


def as_token_list(ids: Sequence[int]) -> list[int]:
    """Validate token ids coming from a caller."""
    out = [int(t) for t in ids]
    if any(t < 0 for t in out):
        raise InvalidRequest("token ids must be >= 0")
    return out
