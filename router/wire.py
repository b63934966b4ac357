"""The translation between router jobs/events and the scheduler API's messages."""

from __future__ import annotations

from smg_grpc_proto import sglang_scheduler_pb2 as pb

from common.defaults import DEFAULT_BOOTSTRAP_PORT
from common.sampling import PROTO_CONSTRAINT_FIELDS, SamplingParams
from router.contract import GenerationJob, TokenEvent
from router.nodes import NodeState


def build_request(
    job: GenerationJob, request_id: str, room: int, prefill: NodeState | None, stream_interval: int = 0
) -> pb.GenerateRequest:
    """The GenerateRequest both legs get (SMG sends them identical); `stream_interval` > 0 asks
    the decode for at least that many tokens a message (the router's pacing)."""
    s: SamplingParams = job.sampling
    sp = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty,
        max_new_tokens=s.max_new_tokens,
        min_new_tokens=s.min_new_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        n=1,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=True,
        stream_interval=max(stream_interval, s.stream_interval),
    )
    for token, bias in s.logit_bias:  # keyed by the id as a string, as in OpenAI's JSON
        sp.logit_bias[str(token)] = bias
    if s.constraint is not None:  # the proto's `constraint` oneof
        setattr(sp, PROTO_CONSTRAINT_FIELDS[s.constraint.kind], s.constraint.spec)
    if s.seed is not None:  # SGLang's place for a sampling seed
        sp.custom_params.update({"seed": s.seed})
    req = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=list(job.input_ids)),
        sampling_params=sp,
        return_logprob=s.logprobs,
        top_logprobs_num=s.top_logprobs,
        logprob_start_len=-1,
        stream=True,
    )
    if prefill is not None:
        req.disaggregated_params.CopyFrom(
            pb.DisaggregatedParams(
                bootstrap_host=prefill.spec.host,
                bootstrap_port=prefill.spec.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
                bootstrap_room=room,
            )
        )
    return req


def token_event(ids: list[int], lp: pb.OutputLogProbs | None) -> TokenEvent:
    if lp is None or not lp.token_logprobs:
        return TokenEvent(tuple(ids))
    top = tuple(tuple(zip(t.token_ids, t.values)) for t in lp.top_logprobs)
    return TokenEvent(tuple(ids), tuple(lp.token_logprobs), top)
