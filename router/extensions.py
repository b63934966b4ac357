"""The request fields vLLM and SGLang clients send beyond OpenAI's, and what the router does with each.

Honoured (both endpoints): top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids (the
nodes' sampler), min_tokens (the sampler bans EOS and stop token ids, and stop strings count only
after it), skip_special_tokens (router-side detokenization), include_stop_str_in_output and
SGLang's no_stop_trim (the stop string stays in the text), add_special_tokens (tokenization),
truncate_prompt_tokens (the prompt's last k tokens), request_id and SGLang's rid (the response id),
and structured output: vLLM's guided_json, guided_regex, guided_choice, guided_grammar and
structured_outputs, SGLang's json_schema, regex, ebnf and structural_tag (one grammar constraint
the nodes decode under: router/structured.py).
Honoured (chat): echo, add_generation_prompt, continue_final_message, chat_template_kwargs and
documents (the chat template renderer). OpenAI's own logit_bias and seed are honoured by the
nodes' sampler, and OpenAI's echo on /v1/completions by the router (not with logprobs: the nodes do
not compute the prompt's).

Accepted, and provably without effect here: spaces_between_special_tokens (fast tokenizers, the only
kind served, have no such option: HF, vLLM and SGLang ignore it for them too), length_penalty (it
only weighs beam search, which is off), cache_salt (there is no cross-request prefix cache to
isolate), priority 0 (the default order), and SGLang's separate_reasoning / stream_reasoning (no
reasoning parser is configured, so the text comes back as generated, as SGLang does then).

Refused with a 400 that names the field and why: what the engine cannot do (beam search, prompt
logprobs, allowed_token_ids, bad_words, logits processors, LoRA, hidden
states, priority scheduling, multimodal processor options), per-request chat templates (refused
by default in vLLM as well: a template is code the model's owner chose) and kv_transfer_params (the
router runs the prefill/decode handoff itself).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

_STRICT = ConfigDict(extra="forbid", strict=True)

_REFUSED_SAMPLING: dict[str, str] = {
    "use_beam_search": "beam search is not supported",
    "prompt_logprobs": "prompt logprobs are not supported: the nodes do not compute them",
    "allowed_token_ids": "allowed_token_ids is not supported by the engine's sampler",
    "bad_words": "bad_words is not supported by the engine's sampler",
    "logits_processors": "custom logits processors are not supported",
    "lora_path": "LoRA adapters are not supported",
    "return_hidden_states": "hidden states are not returned by the nodes",
    "kv_transfer_params": "kv_transfer_params is not accepted: the router runs the prefill/decode handoff itself",
}
_REFUSED_CHAT: dict[str, str] = {
    "chat_template": "a per-request chat_template is not accepted; the model's own template is used "
    "(pass template variables in chat_template_kwargs)",
    "mm_processor_kwargs": "multimodal inputs are not supported by this text-only service",
}


def _first_set(model: BaseModel, table: dict[str, str]) -> tuple[str, str] | None:
    """The first field of `table` given a value that would ask for something (not null/false/empty)."""
    for name, why in table.items():
        value = getattr(model, name)
        if value is not None and value is not False and value != [] and value != {}:
            return name, why
    return None


class SamplingExtensions(BaseModel):
    """vLLM/SGLang fields of both endpoints."""

    model_config = _STRICT

    # honoured
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False  # SGLang's name for the same
    add_special_tokens: bool | None = None  # None: the endpoint's default (completions yes, chat no)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # -1: the model's context length
    request_id: str | None = Field(None, min_length=1, max_length=256)
    rid: str | None = Field(None, min_length=1, max_length=256)  # SGLang's name for the same
    # structured output: one grammar constraint (router/structured.py)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    # accepted; no effect here (see the module docstring)
    spaces_between_special_tokens: bool = True
    length_penalty: float | None = None
    cache_salt: str | None = None
    priority: int = 0
    # refused when set
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: Any = None
    lora_path: Any = None
    return_hidden_states: bool = False
    kv_transfer_params: Any = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (the context length) or at least 1")
        return v

    def refused_extension(self) -> tuple[str, str] | None:
        if self.priority != 0:
            return "priority", "priority scheduling is not supported (only the default priority 0)"
        return _first_set(self, _REFUSED_SAMPLING)

    def include_stop_str(self) -> bool:
        return self.include_stop_str_in_output or self.no_stop_trim

    def client_request_id(self) -> str | None:
        return self.request_id or self.rid


class ChatExtensions(BaseModel):
    """vLLM/SGLang fields of /v1/chat/completions."""

    model_config = _STRICT

    # honoured
    echo: bool = False  # prepend the last message's content when it is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # accepted; no effect here (no reasoning parser)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # refused when set
    chat_template: Any = None
    mm_processor_kwargs: Any = None

    def refused_chat_extension(self) -> tuple[str, str] | None:
        return _first_set(self, _REFUSED_CHAT)
