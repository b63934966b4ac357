"""The constraints tool calling sends compile in llguidance (the nodes' grammar engine, read the way the
node reads each kind), accept the calls the parsers expect, token by token, and refuse other
functions or arguments. The vocabulary holds the markers as tokens, as real ones do (Qwen's
<tool_call>, Mistral's [TOOL_CALLS]), and, for the literal forms, does not."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from common.sampling import Constraint
from common.tokenizer import Tokenizer
from router.tools.base import ToolParser
from router.tools.hermes import HermesParser
from router.tools.llama3 import Llama3JsonParser
from router.tools.mistral import MistralParser
from router.tools.schema import NO_PARAMETERS, FunctionSpec

llguidance = pytest.importorskip("llguidance")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FNS = [FunctionSpec("get_weather", CITY, strict=True), FunctionSpec("get_time", NO_PARAMETERS)]
H1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
HBAD = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'
L1 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
M1 = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
M2 = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'


def _with_markers(src: Path, out: Path, as_tokens: bool) -> Tokenizer:
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    if as_tokens:
        hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
        hf.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
        hf.add_special_tokens(["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"])
        hf.save(str(out / "tokenizer.json"))
    return Tokenizer.from_dir(out)


@pytest.fixture(scope="module", params=[True, False], ids=["marker-tokens", "marker-text"])
def vocab(request: Any, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    out = tmp_path_factory.mktemp("vocab")
    tok = _with_markers(tiny_llama_dir, out, request.param)
    lt = llguidance.LLTokenizer(
        (out / "tokenizer.json").read_text(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
    )
    return tok, lt


def _grammar(c: Constraint) -> str:
    """llguidance's grammar for a constraint, by kind, as the node builds it."""
    if c.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(c.spec)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    assert c.kind == "ebnf", c
    return llguidance.grammar_from("ebnf", c.spec)


def accepts(vocab: tuple[Tokenizer, Any], c: Constraint, text: str) -> bool:
    """The matcher takes every token of `text` and may then end."""
    tok, lt = vocab
    m = llguidance.LLMatcher(lt, _grammar(c), log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def parsed(cls: type[ToolParser], text: str) -> list[tuple[str, str]]:
    p = cls()
    p.feed(text)
    p.finish()
    return [(c.name, c.arguments) for c in p.calls]


def _tid(vocab: tuple[Tokenizer, Any]) -> Any:
    """Token ids, without [ARGS]: a vocabulary of Mistral's JSON-array format."""
    return lambda t: None if t == "[ARGS]" else vocab[0].token_to_id(t)


def test_hermes_required_and_named(vocab: tuple[Tokenizer, Any]) -> None:
    parallel = HermesParser.required_constraint(FNS, True, _tid(vocab))
    assert accepts(vocab, parallel, H1) and accepts(vocab, parallel, f"{H1}\n{H2}")
    assert not accepts(vocab, parallel, HBAD) and not accepts(vocab, parallel, "Sure. " + H1)
    single = HermesParser.required_constraint(FNS, False, _tid(vocab))
    assert accepts(vocab, single, H2) and not accepts(vocab, single, f"{H1}\n{H2}")
    named = HermesParser.required_constraint(FNS[1:], False, _tid(vocab))
    assert accepts(vocab, named, H2) and not accepts(vocab, named, H1)
    assert parsed(HermesParser, f"{H1}\n{H2}") == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_hermes_auto_with_a_strict_tool(vocab: tuple[Tokenizer, Any]) -> None:
    auto = HermesParser.auto_constraint(FNS, _tid(vocab))
    assert accepts(vocab, auto, "Just text, no call.")
    assert accepts(vocab, auto, f"Let me look.\n{H1}")
    assert accepts(vocab, auto, f"{H2}")  # get_time is not strict: any object
    assert not accepts(vocab, auto, f"Let me look.\n{HBAD}")  # get_weather is strict


def test_llama3_required_and_auto(vocab: tuple[Tokenizer, Any]) -> None:
    required = Llama3JsonParser.required_constraint(FNS, True, _tid(vocab))
    assert required.kind == "json_schema" and accepts(vocab, required, L1)
    assert not accepts(vocab, required, L1.replace("city", "town"))
    auto = Llama3JsonParser.auto_constraint(FNS, _tid(vocab))
    assert accepts(vocab, auto, "Hello there.") and accepts(vocab, auto, L1)
    assert not accepts(vocab, auto, L1.replace("city", "town"))
    assert parsed(Llama3JsonParser, L1) == [("get_weather", '{"city": "Paris"}')]


def test_mistral_required_and_auto(vocab: tuple[Tokenizer, Any]) -> None:
    parallel = MistralParser.required_constraint(FNS, True, _tid(vocab))
    assert accepts(vocab, parallel, M1) and accepts(vocab, parallel, M2)
    single = MistralParser.required_constraint(FNS, False, _tid(vocab))
    assert accepts(vocab, single, M1) and not accepts(vocab, single, M2)
    auto = MistralParser.auto_constraint(FNS, _tid(vocab))
    assert accepts(vocab, auto, "Plain answer.") and accepts(vocab, auto, f"Sure. {M1}")
    assert not accepts(vocab, auto, M1.replace("city", "town"))
    assert parsed(MistralParser, M2) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_mistral_v11(vocab: tuple[Tokenizer, Any]) -> None:
    """A vocabulary with an [ARGS] token writes calls as [TOOL_CALLS]NAME[ARGS]{...}."""
    tid = vocab[0].token_to_id
    if tid("[ARGS]") is None:
        pytest.skip("v11 needs its control tokens")
    one = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    two = one + "[TOOL_CALLS]get_time[ARGS]{}"
    parallel = MistralParser.required_constraint(FNS, True, tid)
    assert accepts(vocab, parallel, one) and accepts(vocab, parallel, two)
    assert not accepts(vocab, parallel, one.replace("city", "town"))
    single = MistralParser.required_constraint(FNS, False, tid)
    assert accepts(vocab, single, one) and not accepts(vocab, single, two)
    auto = MistralParser.auto_constraint(FNS, tid)
    assert accepts(vocab, auto, "Plain.") and accepts(vocab, auto, "Sure." + one)
    assert not accepts(vocab, auto, "Sure." + one.replace("city", "town"))
    assert parsed(MistralParser, two) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_structured_output_constraints(vocab: tuple[Tokenizer, Any]) -> None:
    from router.structured import ANY_OBJECT, choice_regex, check_json_schema

    assert accepts(vocab, Constraint("json_schema", ANY_OBJECT), '{"a": [1, "x"]}')
    schema = Constraint("json_schema", check_json_schema(CITY, "s"))
    assert accepts(vocab, schema, '{"city": "Paris"}') and not accepts(vocab, schema, '{"town": "Paris"}')
    choice = Constraint("regex", choice_regex(["yes", "no way", "a.b (c)|d"], "c"))
    assert accepts(vocab, choice, "no way") and accepts(vocab, choice, "a.b (c)|d")
    assert not accepts(vocab, choice, "axb (c)|d")
