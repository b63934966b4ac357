"""Tool-call parsers: each format's calls and content, and the fuzz that matters under speculation:
the same output, re-split at every token boundary into deltas of 1..N tokens (and at random
character cuts), always yields the same calls and the same content."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from common.detokenize import IncrementalDetokenizer
from common.tokenizer import Tokenizer
from router.tools.base import ToolParser
from router.tools.hermes import HermesParser
from router.tools.llama3 import Llama3JsonParser
from router.tools.mistral import MistralParser
from router.tools.registry import PARSERS, detect, parser_named, resolve

W = '{"city": "Paris", "unit": "c", "note": "a } and a \\" inside"}'
# (parser, model output, expected content, expected [(name, arguments)])
CASES: list[tuple[type[ToolParser], str, str, list[tuple[str, str]]]] = [
    (
        HermesParser,
        f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Checking.\n",
        [("get_weather", W), ("get_time", "{}")],
    ),
    (HermesParser, '<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>', "", [("f", '{"a": [1, 2]}')]),
    (HermesParser, "No tools <tool here, just a <b>tag</b>.", "No tools <tool here, just a <b>tag</b>.", []),
    (HermesParser, '<tool_call>\n{"oops": 1}\n</tool_call>', '<tool_call>\n{"oops": 1}\n</tool_call>', []),
    (HermesParser, '<tool_call>\n{"name": "f"}\n</tool_call>', "", [("f", "{}")]),
    (
        Llama3JsonParser,
        f'  {{"name": "get_weather", "parameters": {W}}}; {{"name": "t", "parameters": "{{\\"a\\": 1}}"}}',
        "",
        [("get_weather", W), ("t", '{"a": 1}')],
    ),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"x": 1.5e3}}', "", [("f", '{"x": 1.5e3}')]),
    (Llama3JsonParser, '{"answer": 42}', '{"answer": 42}', []),
    (Llama3JsonParser, 'Text first {"name": "f", "parameters": {}}', 'Text first {"name": "f", "parameters": {}}', []),
    (
        MistralParser,
        'Sure [TOOL_CALLS][{"name": "a", "arguments": {"x": [1, {"y": "}]"}]}}, {"name": "b", "arguments": {}}]',
        "Sure ",
        [("a", '{"x": [1, {"y": "}]"}]}'), ("b", "{}")],
    ),
    (MistralParser, "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    (
        MistralParser,
        f"On it.[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{{}}",
        "On it.",
        [("get_weather", W), ("get_time", "{}")],
    ),
    (MistralParser, "[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
]


def run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict[str, Any]]]:
    """Feed the pieces; (content, [(name, arguments)] reassembled from the deltas, every delta entry)."""
    content, calls, entries = "", {}, []
    for piece in [*pieces, None]:
        d = parser.feed(piece) if piece is not None else parser.finish()
        content += d.content
        for e in d.calls:
            entries.append(e)
            if "id" in e:
                assert e["index"] not in calls and e["type"] == "function"
                calls[e["index"]] = [e["function"]["name"], ""]
            calls[e["index"]][1] += e["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in range(len(calls))], entries  # type: ignore[misc]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_whole_output(cls: type[ToolParser], text: str, content: str, calls: list[tuple[str, str]]) -> None:
    parser = cls()
    got_content, got_calls, _ = run(parser, [text])
    assert (got_content, got_calls) == (content, calls)
    assert parser.content == content and [(c.name, c.arguments) for c in parser.calls] == calls
    for _, args in calls:
        json.loads(args)


def _token_pieces(tok: Tokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    """The text each delta of `sizes` tokens shows, through the router's incremental detokenizer."""
    detok = IncrementalDetokenizer(tok)
    pieces, at = [], 0
    for n in sizes:
        pieces.append(detok.feed(ids[at : at + n]))
        at += n
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_every_token_split_gives_the_same_calls(
    tok: Tokenizer, cls: type[ToolParser], text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    for n in range(1, 6):  # n tokens per delta, the first delta shifted by every offset
        for offset in range(n):
            sizes = ([offset] if offset else []) + [n] * (len(ids) // n + 1)
            assert run(cls(), _token_pieces(tok, ids, sizes))[:2] == (content, calls), (n, offset)
    rng = random.Random(0)
    for _ in range(50):  # ragged deltas, as speculation delivers them
        sizes = [rng.randint(1, 8) for _ in range(len(ids))]
        assert run(cls(), _token_pieces(tok, ids, sizes))[:2] == (content, calls)


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_every_character_cut_gives_the_same_calls(
    cls: type[ToolParser], text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    for cut in range(1, len(text)):
        assert run(cls(), [text[:cut], text[cut:]])[:2] == (content, calls), cut
    assert run(cls(), list(text))[:2] == (content, calls)


def test_stream_shape_first_delta_names_the_call() -> None:
    """id, type and name come once per call, in its first entry; every entry carries its index."""
    text = CASES[0][1]
    _, _, entries = run(HermesParser(), list(text))
    firsts = [e for e in entries if "id" in e]
    assert [e["index"] for e in firsts] == [0, 1]
    assert all(
        set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in entries if "id" not in e
    )
    assert all(e["id"].startswith("call_") and len(e["id"]) == 29 for e in firsts)
    assert len(MistralParser.new_id()) == 9 and MistralParser.new_id().isalnum()


def test_max_calls_keeps_the_first() -> None:
    content, calls, _ = run(HermesParser(max_calls=1), [CASES[0][1]])
    assert content == "Checking.\n" and calls == [("get_weather", W)]


def test_content_that_might_open_a_call_is_held_back() -> None:
    p = HermesParser()
    assert p.feed("Hi <tool").content == "Hi "
    assert p.feed("box>").content == "<toolbox>"
    llama = Llama3JsonParser()
    assert llama.feed("  ").content == ""  # a JSON call may follow the leading whitespace
    assert llama.feed("Hello").content == "  Hello"


def test_an_unfinished_call_keeps_what_arrived() -> None:
    """Cut by max_tokens inside the arguments: the call is there with the argument text it got."""
    content, calls, _ = run(HermesParser(), ['<tool_call>\n{"name": "f", "arguments": {"a": "long te'])
    assert content == "" and calls == [("f", '{"a": "long te')]


def test_registry_and_detection() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert detect(["... <tool_call>{...}</tool_call> ..."]) is HermesParser
    assert detect(["{% if x %}[TOOL_CALLS]{% endif %}"]) is MistralParser
    assert detect(["<|python_tag|>"]) is Llama3JsonParser
    assert detect(["{{ messages }}"]) is None
    assert resolve("mistral", ["<tool_call>"]) is MistralParser and resolve(None, ["<tool_call>"]) is HermesParser
    with pytest.raises(ValueError, match="hermes"):
        parser_named("pythonic")


def test_long_arguments_stream_in_linear_time() -> None:
    """A file's text as an argument, a few characters per delta: each scan resumes where the last stopped."""
    content = 'def f(x):\n    return "a\\\\b" + str(x)  # {[ ]}\n' * 250
    text = "<tool_call>\n" + json.dumps({"name": "write", "arguments": {"path": "a.py", "content": content}})
    parser = HermesParser()
    t0 = time.perf_counter()
    _, calls, _ = run(parser, [text[i : i + 3] for i in range(0, len(text), 3)])
    assert time.perf_counter() - t0 < 1.5  # about 0.05 s; rescanning from the start took seconds
    assert json.loads(calls[0][1])["content"] == content


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["str", "int", "float", "bool", "null", "list", "dict"] if depth < 3 else ["str", "int"])
    if kind == "str":
        return "".join(rng.choice('ab {}[]"\\/\n\té世🎉,:') for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.randint(-1000, 10**6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3)
    if kind in ("bool", "null"):
        return rng.choice([True, False]) if kind == "bool" else None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


class MistralV11(MistralParser):
    """The same parser, fed Mistral's v11 format."""


FORMATS: dict[type[ToolParser], Any] = {
    HermesParser: lambda calls: "\n".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}\n</tool_call>'
        for n, a in calls
    ),
    Llama3JsonParser: lambda calls: "; ".join(
        f'{{"name": "{n}", "parameters": {json.dumps(a, ensure_ascii=False)}}}' for n, a in calls
    ),
    MistralParser: lambda calls: (
        "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    ),
    MistralV11: lambda calls: "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls),
}


@pytest.mark.parametrize("cls", list(FORMATS))
def test_random_arguments_survive_random_cuts(cls: type[ToolParser]) -> None:
    rng = random.Random(7)
    for _ in range(60):
        calls = [(f"f{i}", {f"a{j}": _random_value(rng) for j in range(rng.randint(0, 3))}) for i in range(3)]
        text = FORMATS[cls](calls)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 30))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        _, got, _ = run(cls(), pieces)
        assert [(n, json.loads(a)) for n, a in got] == calls
