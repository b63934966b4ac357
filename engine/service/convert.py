"""Translation between SGLang scheduler API messages (smg-grpc-proto) and engine objects."""

from __future__ import annotations

from smg_grpc_proto import sglang_scheduler_pb2 as pb

from common.sampling import PROTO_CONSTRAINT_FIELDS, Constraint
from engine.core import FinishReason, InvalidRequest, SamplingParams
from engine.scheduler import RequestUpdate

DEFAULT_MAX_NEW_TOKENS = 128  # what SGLang assumes when a request leaves it unset


def sampling_params(req: pb.GenerateRequest, max_new_tokens_cap: int) -> SamplingParams:
    """Engine sampling parameters from a GenerateRequest; InvalidRequest names a bad field."""
    sp = req.sampling_params
    if sp.n > 1:
        raise InvalidRequest("n > 1 is not supported by a worker; the router splits such requests")
    max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    return SamplingParams(
        max_new_tokens=max(1, min(max_new, max_new_tokens_cap)),
        min_new_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p if sp.top_p > 0 else 1.0,  # proto3 default 0 means "unset"
        top_k=sp.top_k if sp.top_k > 0 else -1,
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty if sp.repetition_penalty > 0 else 1.0,
        stop_token_ids=tuple(sp.stop_token_ids),
        stop=tuple(sp.stop),
        ignore_eos=sp.ignore_eos,
        logprobs=req.return_logprob,
        top_logprobs=max(0, req.top_logprobs_num),
        seed=_seed(sp),
        skip_special_tokens=sp.skip_special_tokens,
        logit_bias=_logit_bias(sp),
        constraint=_constraint(sp),
        stream_interval=sp.stream_interval,
    )


def _constraint(sp: pb.SamplingParams) -> Constraint | None:
    """The proto's `constraint` oneof, by our kind names."""
    field = sp.WhichOneof("constraint")
    if field is None:
        return None
    kind = next(k for k, f in PROTO_CONSTRAINT_FIELDS.items() if f == field)
    return Constraint(kind, getattr(sp, field))


def _logit_bias(sp: pb.SamplingParams) -> tuple[tuple[int, float], ...]:
    """The proto's map keys token ids as strings (OpenAI's JSON shape)."""
    try:
        return tuple(sorted((int(k), float(v)) for k, v in sp.logit_bias.items()))
    except ValueError:
        raise InvalidRequest("logit_bias keys must be token ids") from None


def _seed(sp: pb.SamplingParams) -> int | None:
    """SGLang carries a sampling seed among custom params; honour it when present."""
    if sp.HasField("custom_params") and "seed" in sp.custom_params.fields:
        return int(sp.custom_params.fields["seed"].number_value)
    return None


def finish_reason(reason: FinishReason | None) -> str:
    return (reason or FinishReason.ABORT).value


def chunk(
    rid: str,
    tokens: list[int],
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[float] | None = None,
    top: list | None = None,
    cached_tokens: int = 0,
) -> pb.GenerateResponse:
    c = pb.GenerateStreamChunk(
        token_ids=tokens, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens
    )
    if logprobs:
        c.output_logprobs.CopyFrom(output_logprobs(tokens, logprobs, top))
    return pb.GenerateResponse(request_id=rid, chunk=c)


def complete(
    rid: str,
    output_ids: list[int],
    reason: FinishReason | None,
    prompt_tokens: int,
    *,
    logprobs: list[float] | None = None,
    top: list | None = None,
    matched_stop: int | str | None = None,
    accepted_drafts: int = 0,
    verifies: int = 0,
    cached_tokens: int = 0,
) -> pb.GenerateResponse:
    c = pb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=finish_reason(reason),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=len(output_ids),
        spec_accepted_tokens=accepted_drafts,
        spec_draft_tokens=verifies,
    )
    if isinstance(matched_stop, int):
        c.matched_token_id = matched_stop
    elif isinstance(matched_stop, str):
        c.matched_stop_str = matched_stop
    if logprobs:
        c.output_logprobs.CopyFrom(output_logprobs(output_ids, logprobs, top))
    return pb.GenerateResponse(request_id=rid, complete=c)


def output_logprobs(ids: list[int], values: list[float], top: list | None) -> pb.OutputLogProbs:
    out = pb.OutputLogProbs(token_logprobs=values, token_ids=ids[: len(values)])
    for entry in top or []:
        out.top_logprobs.append(pb.TopLogProbs(token_ids=[t for t, _ in entry], values=[v for _, v in entry]))
    return out


def matched_stop_token(update: RequestUpdate, stop_token_ids: tuple[int, ...], eos: frozenset[int]) -> int | None:
    """The token that ended a request with finish reason STOP, if it was a token."""
    if update.finish_reason is FinishReason.STOP and update.tokens:
        last = update.tokens[-1]
        if last in stop_token_ids or last in eos:
            return last
    return None
