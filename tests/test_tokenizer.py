"""Tokenizer, chat template, incremental detokenizer, stop strings, and the tiny model writer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Sequence

import pytest

from common.detokenize import IncrementalDetokenizer, StopStringMatcher
from common.tokenizer import ChatTemplateError, Tokenizer, TokenizerFileNotFoundError

TEXTS = [
    "def fibonacci(n):\n    return n",
    "hello world",
    "  leading and trailing spaces  ",
    "héllo café naïve ñandú",
    "世界你好，中文文本",
    "emoji 🎉👍🏽 and a family 👨‍👩‍👧",
    "mixed: ö 世 🎉 — “quotes” <tags> & \t tabs\n\nnewlines",
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def _copy_with(src: Path, dst: Path, **config_changes: Any) -> Path:
    """A copy of a tokenizer dir with tokenizer_config.json keys changed (None deletes)."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    return dst


# --- Tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.decode(plain) == text
    with_bos = tok.encode(text)
    assert with_bos == [tok.bos_token_id, *plain]
    assert tok.decode(with_bos) == text
    assert tok.decode(with_bos, skip_special_tokens=False) == "<|bos|>" + text


def test_properties(tok: Tokenizer, tiny_llama_dir: Path) -> None:
    assert tok.bos_token_id == tok.token_to_id("<|bos|>")
    assert tok.eos_token_ids == (tok.token_to_id("<|eos|>"),)
    assert tok.vocab_size == 512
    assert tok.name_or_path == str(tiny_llama_dir)
    assert len(tok.encode("def fibonacci(n):", add_special_tokens=False)) < len("def fibonacci(n):")  # merges


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoTokenizer

    path = request.getfixturevalue(fixture)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🎉"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, gen) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(messages) == "<|bos|><|user|>hi<|eos|><|assistant|>yo<|eos|><|assistant|>"
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("yo<|eos|>")
    ids = tok.encode_chat(messages[:1])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template's BOS only
    with pytest.raises(ChatTemplateError, match="unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template_is_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bare = Tokenizer.from_dir(_copy_with(tiny_llama_dir, tmp_path / "t", chat_template=None))
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_template_helpers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    templates = [
        {
            "name": "default",
            "template": (
                "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
                "{% generation %}[{{ strftime_now('%Y') }}]{% endgeneration %}"
                "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
            ),
        },
        {"name": "tool_use", "template": "{{ tools | tojson(indent=None) }}"},
    ]
    tok = Tokenizer.from_dir(_copy_with(tiny_llama_dir, tmp_path / "t", chat_template=templates))
    out = tok.apply_chat_template([{"role": "user", "content": "<b> & 世界"}])
    # HF's tojson neither HTML-escapes nor ASCII-escapes.
    assert out.startswith('"<b> & 世界"[') and out.endswith("]01")
    assert out[len('"<b> & 世界"[') : -3].isdigit()
    tools = [{"name": "f", "description": "a < b"}]
    assert tok.apply_chat_template([], tools=tools) == '[{"name": "f", "description": "a < b"}]'
    assert tok.apply_chat_template([], template_name="tool_use", tools=[]) == "[]"
    with pytest.raises(ChatTemplateError, match="no chat template named"):
        tok.apply_chat_template([], template_name="nope")


def test_chat_template_jinja_file_wins(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy_with(tiny_llama_dir, tmp_path / "t")
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_missing_files_are_clear_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        Tokenizer.from_dir(tmp_path / "does-not-exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerFileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(empty)


def test_side_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = _copy_with(
        tiny_llama_dir, tmp_path / "t", add_bos_token=False, bos_token={"content": "<|bos|>", "special": True}
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == (1, 3)  # tokenizer eos (1) first, no duplicates
    assert tok.bos_token_id == 0
    assert tok.encode("hi")[0] != 0  # add_bos_token=False overrides tokenizer.json's post-processor


# --- IncrementalDetokenizer --------------------------------------------------------------------


class CountingDecoder:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    out, i = [], 0
    for n in chunks:
        out.append(detok.feed(ids[i : i + n]))
        i += n
    assert i >= len(ids)
    return out + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_one_token_at_a_time(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok), ids, [1] * len(ids))
    assert all("\ufffd" not in d for d in deltas), deltas  # never a partial character
    assert "".join(deltas) == text == tok.decode(ids)
    assert deltas[-1] == ""  # nothing was left held back


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_random_chunks_and_specials(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids: list[int] = []
    for text in rng.sample(TEXTS, 4):
        ids += tok.encode(text, add_special_tokens=False) + [tok.token_to_id(rng.choice(["<|eos|>", "<|user|>"]))]
    chunks = [rng.randint(1, 5) for _ in range(len(ids))]
    for skip in (True, False):
        deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, chunks)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(30))
def test_detokenizer_invalid_utf8_stays_consistent(tok: Tokenizer, seed: int) -> None:
    # What a random-weight model emits: arbitrary ids, often bytes that are not valid UTF-8,
    # including long runs of lead/continuation bytes that never complete a character.
    rng = random.Random(seed)
    high = [tok.token_to_id(c) for c in ("Ã", "Ä", "Â", "¤", "¸", "ð", "â")]  # byte-level symbols of 0x80+ bytes
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 300))]
    ids += [rng.choice(high) for _ in range(rng.randint(0, 200))]
    ids += tok.encode("ok 世界", add_special_tokens=False) + [rng.choice(high)]
    chunks = [rng.choice([1, 1, 1, 2, 7]) for _ in range(len(ids))]
    skip = seed % 2 == 0
    counter = CountingDecoder(tok)
    deltas = _stream(IncrementalDetokenizer(counter, skip_special_tokens=skip), ids, chunks)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert max(counter.sizes) <= 2 * (16 + 7)  # window stays bounded: O(new tokens), not O(sequence)


def test_detokenizer_emits_up_to_a_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("ab世", add_special_tokens=False)
    assert len(ids) >= 4  # "ab" plus the three byte tokens of 世
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(ids[:-2]) == "ab"  # the complete text before the partial character
    assert detok.feed(ids[-2]) == ""
    assert detok.feed(ids[-1]) == "世"
    assert detok.flush() == ""
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(ids[:-1]) == "ab" and detok.flush() == "\ufffd"  # an unfinished char at the end


def test_detokenizer_work_is_bounded(tok: Tokenizer) -> None:
    ids = tok.encode("plain ascii text with words " * 200, add_special_tokens=False)
    counter = CountingDecoder(tok)
    detok = IncrementalDetokenizer(counter)
    text = "".join(detok.feed(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert max(counter.sizes) <= 3


def test_detokenizer_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("say: ", add_special_tokens=True)
    out = tok.encode("héllo 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.feed(i) for i in out) + detok.flush() == "héllo 🎉"


# --- StopStringMatcher -------------------------------------------------------------------------


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out, stopped = "", False
    for d in deltas:
        text, stopped = m.feed(d)
        out += text
        if stopped:
            break
    return out + m.flush(), stopped


@pytest.mark.parametrize(
    "stops,deltas,expected",
    [
        (["STOP"], ["hello STOP world"], ("hello ", True)),
        (["STOP"], ["hel", "lo S", "T", "OP", " world"], ("hello ", True)),  # split across deltas
        (["STOP"], ["STOP"], ("", True)),  # at the very start
        (["STOP"], ["S", "TOP"], ("", True)),
        (["STOP"], ["hello ST", "ART"], ("hello START", False)),  # held back, then released
        (["STOP"], ["the end ST"], ("the end ST", False)),  # held back, released by flush
        (["aab"], ["a", "a", "a", "b", "c"], ("a", True)),  # self-overlapping prefix
        (["abcd", "bc"], ["a", "bc", "d"], ("a", True)),  # earliest occurrence wins
        (["abcd", "bcx"], ["ab", "cx"], ("a", True)),  # a longer candidate fails, a later one hits
        (["\n\n", "</s>"], ["line\n", "\n</s>"], ("line", True)),
        (["世界"], ["你好世", "界!"], ("你好", True)),
        (["x"], ["", "ab", "", "cxd"], ("abc", True)),
    ],
)
def test_stop_strings(stops: list[str], deltas: list[str], expected: tuple[str, bool]) -> None:
    assert _run(stops, deltas) == expected


def test_stop_matcher_state() -> None:
    m = StopStringMatcher(["END", "ENDING"])
    assert m.feed("the EN") == ("the ", False)
    assert m.feed("D is near") == ("", True)
    assert m.matched == "END" and m.stopped
    assert m.feed("more") == ("", True) and m.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher([""])


@pytest.mark.parametrize("seed", range(20))
def test_stop_matcher_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("abc") for _ in range(60))
    stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), 10))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    expected = (text[: min(hits)], True) if hits else (text, False)
    assert _run(stops, deltas) == expected


@pytest.mark.parametrize("seed", range(30))
def test_stop_matcher_ignores_matches_ending_in_protected_text(seed: int) -> None:
    """min_tokens: no stop string may end in the first deltas' text; one that starts there and
    ends later counts. Reference: the earliest match ending past the protected prefix."""
    rng = random.Random(seed)
    text = "".join(rng.choice("abc") for _ in range(60))
    stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(1, len(text)), 10))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    n_protected = rng.randint(0, len(deltas))
    floor = sum(len(d) for d in deltas[:n_protected])
    m, out, stopped = StopStringMatcher(stops), "", False
    for k, d in enumerate(deltas):
        piece, stopped = m.feed(d, can_stop=k >= n_protected)
        out += piece
        if stopped:
            break
    out += m.flush()
    starts = [text.find(s, max(0, floor - len(s) + 1)) for s in stops]
    hits = [i for i in starts if i != -1]
    assert (out, stopped) == ((text[: min(hits)], True) if hits else (text, False))


def test_text_assembler_min_tokens(tiny_llama_dir: Path) -> None:
    from common.detokenize import TextAssembler

    tok = Tokenizer.from_dir(tiny_llama_dir)
    ids = tok.encode("ab ab ab ab", add_special_tokens=False)
    per = [tok.decode(ids[: k + 1]) for k in range(len(ids))]
    first_ab = next(k for k, t in enumerate(per) if t.endswith("ab")) + 1  # tokens until "ab" shows
    for min_tokens, fed in ((0, [ids]), (first_ab, [ids]), (first_ab, [[i] for i in ids])):
        ta = TextAssembler(tok, ["ab"], min_tokens=min_tokens)
        out, hit = "", False
        for chunk in fed:
            piece, hit = ta.feed(chunk)
            out += piece
            if hit:
                break
        assert hit and ta.matched == "ab"
        # min 0: stops at the first "ab"; min = the tokens that spell it: that one is ignored
        assert out == ("" if min_tokens == 0 else "ab ")


# --- tiny model directories --------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_tiny_models_load_in_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig

    path = request.getfixturevalue(fixture)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    cfg = ModelConfig.from_dir(path)
    assert cfg.vocab_size % 8 == 0 and cfg.vocab_size >= Tokenizer.from_dir(path).vocab_size
    assert model.config.head_dim == cfg.head_dim
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 6, 7]])).logits
    assert logits.shape == (1, 4, cfg.vocab_size) and torch.isfinite(logits).all()


def test_tiny_model_weights(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from fixtures.tiny_model import write_tiny_model

    index = json.loads((tiny_qwen3_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weights = {k: v for f in files for k, v in load_file(tiny_qwen3_dir / f).items()}
    assert set(weights) == set(index["weight_map"])
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    norm = weights["model.norm.weight"]
    assert (norm - 1).abs().max() > 0.01 and (norm - 1).abs().mean() < 0.5  # near 1, not exactly 1

    a = load_file(write_tiny_model(tmp_path / "a", "Qwen2ForCausalLM", seed=7) / "model.safetensors")
    b = load_file(write_tiny_model(tmp_path / "b", "Qwen2ForCausalLM", seed=7) / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # seeded: reproducible
    assert "model.layers.1.self_attn.k_proj.bias" in a and "lm_head.weight" in a
    bf16 = write_tiny_model(tmp_path / "c", dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
