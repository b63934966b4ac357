"""The vLLM/SGLang request fields: each honoured one changes what it should (checked on the job the
nodes get, or on the text), the no-ops are accepted, the rest are refused naming the field. Sent
through the official client's `extra_body`, as such clients do, or raw where that is simpler."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from common.tokenizer import Tokenizer
from router.extensions import _REFUSED_CHAT, _REFUSED_SAMPLING
from router.wire import build_request
from tests.router.fake_dispatcher import Script, server, sse_lines
from tests.router.test_app import MODEL, check_error, make, stream_text

U: list[Any] = [{"role": "user", "content": "hi"}]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
    "{% if documents %}[docs:{% for d in documents %}{{ d['title'] }};{% endfor %}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny tokenizer with a Qwen3-like template: `enable_thinking` and `documents` show in the prompt."""
    out = tmp_path_factory.mktemp("tok")
    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, out / f.name)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return Tokenizer.from_dir(out)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)


def _chat(app: Any, stream: bool = False, **body: Any) -> Any:
    r = TestClient(app).post("/v1/chat/completions", json={"model": MODEL, "messages": U, "stream": stream, **body})
    assert r.status_code == 200, r.text
    return stream_text(sse_lines(r.text), chat=True)[0] if stream else r.json()["choices"][0]["message"]["content"]


def _cmpl(app: Any, stream: bool = False, **body: Any) -> str:
    r = TestClient(app).post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream, **body})
    assert r.status_code == 200, r.text
    return stream_text(sse_lines(r.text), chat=False)[0] if stream else r.json()["choices"][0]["text"]


def test_sampling_fields_reach_the_nodes(tok: Tokenizer) -> None:
    app, fake = make(tok)
    extra = {
        "top_k": 1,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "ignore_eos": True,
        "stop_token_ids": [7],
        "min_tokens": 3,
        "skip_special_tokens": False,
    }
    with server(app) as url:
        _client(url).completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=extra)
        _client(url).chat.completions.create(model=MODEL, messages=U, max_tokens=8, extra_body=extra)
    for job in fake.jobs:
        s = job.sampling
        assert (
            s.top_k,
            s.min_p,
            s.repetition_penalty,
            s.ignore_eos,
            s.stop_token_ids,
            s.min_new_tokens,
            s.skip_special_tokens,
        ) == (1, 0.1, 1.2, True, (7,), 3, False)
        sp = build_request(job, job.request_id, 1, None).sampling_params  # what goes over gRPC
        assert (sp.top_k, sp.min_new_tokens, sp.ignore_eos, list(sp.stop_token_ids), sp.skip_special_tokens) == (
            1,
            3,
            True,
            [7],
            False,
        )
        assert sp.min_p == pytest.approx(0.1) and sp.repetition_penalty == pytest.approx(1.2)


def test_logit_bias_reaches_the_nodes_and_is_checked(tok: Tokenizer) -> None:
    app, fake = make(tok)
    with server(app) as url:
        _client(url).completions.create(model=MODEL, prompt="x", logit_bias={"12": -100, "7": 2.5})
    assert fake.jobs[0].sampling.logit_bias == ((7, 2.5), (12, -100.0))
    sp = build_request(fake.jobs[0], "r", 1, None).sampling_params
    assert dict(sp.logit_bias) == {"7": 2.5, "12": -100.0}
    client = TestClient(app)
    for bias in ({"x": 1}, {"5": 101}, {str(tok.vocab_size): 1}):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": U, "logit_bias": bias})
        check_error(r, 400, "logit_bias", "invalid_value")


def test_min_tokens_is_bounded_and_holds_back_stop_strings(tok: Tokenizer) -> None:
    app, _ = make(tok, lambda job: Script(reply="ab ab ab"))
    client = TestClient(app)
    check_error(
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "min_tokens": 5}),
        400,
        "min_tokens",
        "invalid_value",
    )
    check_error(
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": U, "min_tokens": 500}),
        400,
        "min_tokens",
        "invalid_value",
    )
    check_error(
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "min_tokens": -1}),
        400,
        "min_tokens",
        "invalid_value",
    )
    ids = tok.encode("ab ab ab", add_special_tokens=False)
    first = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith("ab"))  # tokens spelling "ab"
    for stream in (False, True):
        assert _cmpl(app, stream, stop=["ab"]) == ""
        # the first "ab" ends inside the first min_tokens tokens' text: only the second one stops
        assert _cmpl(app, stream, stop=["ab"], min_tokens=first) == "ab "


def test_skip_special_tokens_and_include_stop_str(tok: Tokenizer) -> None:
    user = tok.token_to_id("<|user|>")
    ids = [*tok.encode("Hello", add_special_tokens=False), user, *tok.encode(" world, done", add_special_tokens=False)]
    app, _ = make(tok, lambda job: Script(tokens=ids))
    for stream in (False, True):
        assert _chat(app, stream) == "Hello world, done"
        assert _chat(app, stream, skip_special_tokens=False) == "Hello<|user|> world, done"
        assert _cmpl(app, stream, stop=["world"]) == "Hello "
        assert _cmpl(app, stream, stop=["world"], include_stop_str_in_output=True) == "Hello world"
        assert _chat(app, stream, stop=["world"], no_stop_trim=True) == "Hello world"


def test_echo(tok: Tokenizer) -> None:
    app, fake = make(tok, lambda job: Script(reply=" and more"))
    for stream in (False, True):
        assert _cmpl(app, stream, prompt="Once upon", echo=True) == "Once upon and more"
    check_error(
        TestClient(app).post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True, "logprobs": 0}),
        400,
        "echo",
        "unsupported_parameter",
    )
    # chat: continue the assistant's last message, and echo it in front of the continuation
    messages = [*U, {"role": "assistant", "content": "Sure, here"}]
    cont = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    for stream in (False, True):
        assert _chat(app, stream, echo=True, **cont) == "Sure, here and more"
        assert _chat(app, stream, **cont) == " and more"
    want = tok.apply_chat_template(messages, add_generation_prompt=False)
    want = want[: want.rindex("Sure, here") + len("Sure, here")]  # no end-of-turn after it
    assert fake.jobs[-1].input_ids == tuple(tok.encode(want, add_special_tokens=False))
    check_error(
        TestClient(app).post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "continue_final_message": True}
        ),
        400,
        "continue_final_message",
        "invalid_value",
    )


def _prompt(fake: Any) -> str:
    return str(fake.tokenizer.decode(list(fake.jobs[-1].input_ids), skip_special_tokens=False))


def test_chat_template_options(tok: Tokenizer) -> None:
    app, fake = make(tok)
    with server(app) as url:
        c = _client(url)
        c.chat.completions.create(model=MODEL, messages=U)
        assert _prompt(fake).endswith("<|assistant|>")
        c.chat.completions.create(
            model=MODEL, messages=U, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert _prompt(fake).endswith("<|assistant|><think></think>")
        c.chat.completions.create(model=MODEL, messages=U, extra_body={"documents": [{"title": "a"}]})
        assert "[docs:a;]" in _prompt(fake)
        c.chat.completions.create(model=MODEL, messages=U, extra_body={"add_generation_prompt": False})
        assert not _prompt(fake).endswith("<|assistant|>")
        c.chat.completions.create(model=MODEL, messages=U, extra_body={"add_special_tokens": True})
        assert fake.jobs[-1].input_ids[:2] == (tok.bos_token_id, tok.bos_token_id)  # the template's and one more
        for key in ("messages", "add_generation_prompt", "bos_token", "tools"):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=MODEL, messages=U, extra_body={"chat_template_kwargs": {key: 1}})
            assert (e.value.param, e.value.code) == (f"chat_template_kwargs.{key}", "invalid_value")


def test_prompt_fields_and_request_id(tok: Tokenizer) -> None:
    app, fake = make(tok)
    with server(app) as url:
        c = _client(url)
        c.completions.create(model=MODEL, prompt=list(range(10, 30)), extra_body={"truncate_prompt_tokens": 4})
        assert fake.jobs[-1].input_ids == (26, 27, 28, 29)
        c.completions.create(model=MODEL, prompt="hi", extra_body={"add_special_tokens": False})
        assert fake.jobs[-1].input_ids == tuple(tok.encode("hi", add_special_tokens=False))
        r = c.chat.completions.create(model=MODEL, messages=U, extra_body={"request_id": "my-id"})
        assert r.id == "chatcmpl-my-id" and fake.jobs[-1].request_id != r.id  # node-side ids stay unique
        assert c.completions.create(model=MODEL, prompt="x", extra_body={"rid": "r2"}).id == "cmpl-r2"
    check_error(
        TestClient(app).post("/v1/completions", json={"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0}),
        400,
        "truncate_prompt_tokens",
        "invalid_value",
    )


NO_OPS = {
    "spaces_between_special_tokens": False,
    "length_penalty": 2.0,
    "cache_salt": "s",
    "priority": 0,
    "separate_reasoning": True,
    "stream_reasoning": False,
}


def test_no_op_fields_are_accepted_and_change_nothing(tok: Tokenizer) -> None:
    app, fake = make(tok)
    client = TestClient(app)
    base = client.post("/v1/chat/completions", json={"model": MODEL, "messages": U, "seed": 1}).json()
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": U, "seed": 1, **NO_OPS})
    assert r.status_code == 200 and r.json()["choices"] == base["choices"]
    assert fake.jobs[0].sampling == fake.jobs[1].sampling and fake.jobs[0].input_ids == fake.jobs[1].input_ids


REFUSED = [
    (
        name,
        {
            "use_beam_search": True,
            "return_hidden_states": True,
            "prompt_logprobs": 1,
            "allowed_token_ids": [1],
            "bad_words": ["x"],
        }.get(name, {"a": 1}),
    )
    for name in [*_REFUSED_SAMPLING, *_REFUSED_CHAT]
] + [("priority", 1)]


@pytest.mark.parametrize("name,value", REFUSED)
def test_refused_fields_name_themselves(tok: Tokenizer, name: str, value: Any) -> None:
    app, fake = make(tok)
    r = TestClient(app).post("/v1/chat/completions", json={"model": MODEL, "messages": U, name: value})
    check_error(r, 400, name, "unsupported_parameter")
    assert "not" in r.json()["error"]["message"] and not fake.jobs
    if name not in _REFUSED_CHAT:  # the sampling ones on the legacy endpoint too
        r = TestClient(app).post("/v1/completions", json={"model": MODEL, "prompt": "x", name: value})
        check_error(r, 400, name, "unsupported_parameter")
