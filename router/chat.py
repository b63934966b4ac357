"""A chat request's prompt: messages checked, rendered by the chat template, and its echo text.

The template gets the request's options (chat_template_kwargs, documents, add_generation_prompt,
continue_final_message) and its tools; `echo` puts the continued assistant message in front of the
answer.
"""

from __future__ import annotations

from typing import Any

from common.tokenizer import ChatTemplateError, Tokenizer
from router.errors import bad_request
from router.messages import template_messages

# Names the renderer itself passes to the template (or takes as its own arguments): a
# chat_template_kwargs entry with one of them would silently replace what the request says.
RESERVED_TEMPLATE_VARS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        "template_name",
        "chat_template",
    }
)
_TOP_LEVEL = {"messages", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    for key in kwargs:
        if key in RESERVED_TEMPLATE_VARS:
            hint = f" Use the top-level '{key}' field." if key in _TOP_LEVEL else ""
            raise bad_request(
                f"chat_template_kwargs may not set '{key}': the renderer sets it itself.{hint}",
                param=f"chat_template_kwargs.{key}",
                code="invalid_value",
            )


def render(tokenizer: Tokenizer, req: Any, tools: list[dict[str, Any]] | None = None) -> tuple[str, str]:
    """(prompt text, echo text) of a validated ChatCompletionRequest; 400s name the bad field."""
    messages = template_messages(req.messages)
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: set "
            "add_generation_prompt to false to continue the last message.",
            param="continue_final_message",
            code="invalid_value",
        )
    kwargs = dict(req.chat_template_kwargs or {})
    _check_kwargs(kwargs)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=tools,
            documents=req.documents,
            **kwargs,
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages", code="invalid_messages") from e
    if req.continue_final_message:
        text = _open_final_message(text, messages[-1]["content"])
    last = messages[-1]
    echo = last["content"] if req.echo and last["role"] == "assistant" else ""
    return text, echo


def _open_final_message(text: str, final: str) -> str:
    """Cut the rendering right after the last message's content (dropping its end-of-turn
    tokens), so the model continues that message, as HF's continue_final_message does."""
    for needle in (final, final.strip()):
        if needle and (at := text.rfind(needle)) != -1:
            return text[: at + len(needle)]
    raise bad_request(
        "continue_final_message needs the last message's content to appear in the rendered chat "
        "(it is empty, or the template does not render it).",
        param="continue_final_message",
        code="invalid_value",
    )
