"""The grammar engine: both backends behind one matcher interface, the compile cache, packed masks on
the logits, and constrained decoding through an engine (conforming output, overlap on == off,
bad grammars refused alone, nothing leaks)."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from common.sampling import Constraint, InvalidRequest
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from engine.grammar.base import mask_words
from engine.grammar.bitmask import MaskRows, apply_token_mask, batch_masks, window_banned, window_masks
from engine.grammar.compiler import GrammarCompiler, make_backend
from fixtures.tiny_model import write_tiny_model

VOCAB = 512
EOS = 1
YES_NO = Constraint("regex", "(yes|no)")
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}
OBJ = Constraint("json_schema", json.dumps(SCHEMA))
BAD = [
    (Constraint("json_schema", '{"type": "foo"}'), "foo"),
    (Constraint("json_schema", "{not json"), "JSON"),
    (Constraint("regex", "(("), "regex"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("grammar"), seed=0)


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def backend(request, model_dir):
    return make_backend(request.param, model_dir, VOCAB, [EOS])


def allowed(words: torch.Tensor) -> list[int]:
    return [t for t in range(VOCAB) if (int(words[t // 32]) >> (t % 32)) & 1]


def encode(model_dir, text: str) -> list[int]:
    from common.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)


def test_matcher_interface(backend, model_dir):
    m = backend.compile(YES_NO.kind, YES_NO.spec).matcher()
    yes = encode(model_dir, "yes")
    words = torch.zeros(mask_words(VOCAB), dtype=torch.int32)
    m.fill_mask(words)
    first = allowed(words)
    assert yes[0] in first and EOS not in first
    assert m.validate(yes) == len(yes) and not m.is_finished()  # validating consumes nothing
    assert not m.advance([yes[0], 999 % VOCAB]) or 999 % VOCAB == yes[1]
    assert m.advance(yes) and m.is_finished() and m.is_accepting()
    m.fill_mask(words)
    assert allowed(words) == [EOS]  # only EOS may follow a finished grammar
    m.rollback(len(yes))
    assert not m.is_finished()
    m.fill_mask(words)
    assert allowed(words) == first


@pytest.mark.parametrize("constraint,names", BAD)
def test_bad_grammar_names_the_problem(backend, constraint, names):
    with pytest.raises(InvalidRequest, match=names):
        backend.compile(constraint.kind, constraint.spec)


def test_compiler_caches_and_forgets_failures(model_dir):
    calls = []

    def factory():
        calls.append(threading.current_thread().name)
        return make_backend("llguidance", model_dir, VOCAB, [EOS])

    c = GrammarCompiler(factory, cache_size=2)
    c.matcher(YES_NO)
    c.matcher(YES_NO)
    assert c.compiles == 1 and len(calls) == 1 and calls[0].startswith("pdserve-grammar")  # built off the caller
    for _ in range(2):
        with pytest.raises(InvalidRequest):
            c.matcher(BAD[0][0])
    assert c.compiles == 3  # a failure is not cached
    c.matcher(OBJ)
    c.matcher(Constraint("regex", "a+"))
    c.matcher(YES_NO)  # evicted by the two above (LRU of 2)
    assert c.compiles == 6
    c.close()


def test_apply_token_mask_matches_a_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (2, mask_words(70)), dtype=torch.int32, generator=g)
    rows = torch.tensor([3, 1])
    out = apply_token_mask(logits.clone(), MaskRows(rows, words))
    ref = logits.clone()
    for k, r in enumerate(rows.tolist()):
        for t in range(70):
            if not (int(words[k, t // 32]) >> (t % 32)) & 1:
                ref[r, t] = float("-inf")
    assert torch.equal(out, ref)


def test_window_masks_walk_drafts(backend, model_dir):
    yes = encode(model_dir, "yes")
    m = backend.compile(YES_NO.kind, YES_NO.spec).matcher()
    solo = batch_masks([m], VOCAB, torch.device("cpu"))
    assert solo is not None
    # a chain: root, then the drafts y-e-s-ish, then a token the grammar refuses
    tokens = [[7] + yes + [5]]
    parents = [list(range(-1, len(tokens[0]) - 1))]
    masks = window_masks([None, m][1:], tokens, parents, VOCAB, torch.device("cpu"))
    assert masks is not None
    assert masks.rows.tolist() == list(range(len(yes) + 1))  # the refused token's row has none
    assert torch.equal(masks.words[0], solo.words[0])  # the root row: the matcher as it stands
    assert allowed(masks.words[len(yes)]) == [EOS]
    assert m.validate(yes) == len(yes) and not m.is_finished()  # rolled back


def _row_by_row(m, tokens: list[int], parents: list[int]) -> torch.Tensor:
    """Reference: each row's mask from its own path, walked down and back (any tree shape)."""
    rows = torch.full((len(tokens), mask_words(VOCAB)), -1, dtype=torch.int32)
    for r in range(len(tokens)):
        path, k = [], r
        while k > 0 and tokens[k] >= 0:
            path.append(tokens[k])
            k = parents[k]
        if k > 0 or m.validate(path[::-1]) != len(path):
            continue
        m.advance(path[::-1])
        m.fill_mask(rows[r])
        m.rollback(len(path))
    return ~rows


def test_chains_and_trees_ban_what_a_row_by_row_walk_bans(backend, model_dir):
    """window_banned walks a chain once (a mask per row, one rollback) and a tree row by row; both
    equal the row-by-row reference, with a refused draft, padding, and an unconstrained request."""
    yes, no = encode(model_dir, "yes"), encode(model_dir, "no")
    m = backend.compile(YES_NO.kind, YES_NO.spec).matcher()
    chain, pad = list(range(-1, 4)), [-1] * 5
    windows = [
        (([7, *yes, 5] + pad)[:5], chain),  # drafts the grammar takes, then one it refuses
        (([7, *no] + pad)[:5], chain),  # padding after the drafts
        ([7, yes[0], no[0], (yes + [5])[1], 5], [-1, 0, 0, 1, 1]),  # a tree: row by row
    ]
    for tokens, parents in windows:
        got = window_banned([m, None], [tokens, tokens], [parents, parents], VOCAB)
        assert torch.equal(got[0], _row_by_row(m, tokens, parents))
        assert not got[1].any()  # no matcher: nothing banned
        assert m.validate(yes) == len(yes)  # the matcher rolled back


# ---------------------------------------------------------------- through an engine


def engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(str(model_dir), page_size=4, chunked_prefill_size=7, **kw))


def params(constraint: Constraint | None, n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=kw.pop("temperature", 0.0), constraint=constraint, **kw)


PROMPTS = ["Is it?", "def f(x):", "hello world", "{"]
MIXED = [
    params(YES_NO),
    params(OBJ, 32),
    params(None, 8),
    params(OBJ, 32, temperature=0.9, seed=5),
]


def conforms(text: str, constraint: Constraint | None) -> bool:
    if constraint is None:
        return True
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    obj = json.loads(text)
    return set(obj) == {"ok", "pick"} and isinstance(obj["ok"], bool) and obj["pick"] in ("red", "green")


def assert_all_returned(eng: Engine) -> None:
    assert not eng.scheduler.has_work
    assert eng.kv.all_free
    eng.kv.check()


@pytest.mark.parametrize("backend_name", ["llguidance", "xgrammar"])
def test_constrained_output_conforms_overlap_on_equals_off(model_dir, backend_name):
    results = []
    for overlap in (False, True):
        eng = engine(model_dir, overlap=overlap, grammar_backend=backend_name)
        outs = eng.generate(PROMPTS, MIXED)
        assert_all_returned(eng)
        for o, p in zip(outs, MIXED):
            if p.constraint is not None:
                assert o.finish_reason.value == "stop", o  # these grammars end well within the budget
                assert conforms(o.text, p.constraint), o.text
        results.append([o.output_ids for o in outs])
    assert results[0] == results[1]


def test_unconstrained_rows_are_untouched(model_dir):
    alone = engine(model_dir).generate(PROMPTS[2:3], [MIXED[2]])[0].output_ids
    together = engine(model_dir).generate(PROMPTS, MIXED)[2].output_ids
    assert alone == together


def test_bad_grammar_fails_alone(model_dir):
    eng = engine(model_dir)
    with pytest.raises(InvalidRequest, match="foo"):
        eng.add_request("x", params(BAD[0][0]))
    outs = eng.generate(PROMPTS[:1], [params(YES_NO)])  # the engine keeps serving
    assert outs[0].text in ("yes", "no")
    assert_all_returned(eng)


def test_structural_tag_constrains_only_inside_the_tag(backend, model_dir):
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    g = backend.compile("structural_tag", json.dumps(tag))
    good = encode(model_dir, 'so <f>{"ok": true, "pick": "red"}</f>')
    bad = encode(model_dir, 'so <f>{"ok": 1}</f>')
    assert g.matcher().validate(good) == len(good)
    assert g.matcher().validate(bad) < len(bad)


def test_retraction_keeps_constrained_output(model_dir):
    """A retracted request keeps its matcher (it has taken exactly its output so far) and
    re-extends: the output equals a run with room to spare."""
    long_regex = Constraint("regex", "[a-f]{40,60}")
    prompts = [[5, 17, 42, 7, 99, 3, 11, 250, 9, i] for i in range(6)]
    ps = [params(long_regex if i % 2 else OBJ, 28) for i in range(6)]
    want = engine(model_dir, max_total_tokens=2048).generate(prompts, ps)
    small = Engine(EngineConfig(str(model_dir), page_size=4, max_total_tokens=64, chunked_prefill_size=16))
    outs = small.generate(prompts, ps)
    assert small.scheduler.stats["retractions"] > 0
    assert [o.output_ids for o in outs] == [o.output_ids for o in want]
    for o, p in zip(outs, ps):
        assert p.constraint is not None and small.grammars is not None
        assert small.grammars.matcher(p.constraint).validate(o.output_ids) == len(o.output_ids)
    assert_all_returned(small)


def test_structural_tag_ends_with_a_special_end_token(model_dir, tmp_path):
    """Where begin and end are special tokens of the vocabulary (Qwen's <tool_call> ...
    </tool_call>), the model's own end token closes the tag: llguidance's text form of the end
    would ban it."""
    import shutil

    from tokenizers import Tokenizer as HFTokenizer

    out = tmp_path / "special"
    shutil.copytree(model_dir, out)
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    hf.add_special_tokens(["<f>", "</f>"])
    hf.save(str(out / "tokenizer.json"))
    tag = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}
    g = make_backend("llguidance", out, VOCAB + 2, [EOS]).compile("structural_tag", json.dumps(tag))
    good = hf.encode('so <f>{"ok": true, "pick": "red"}</f>', add_special_tokens=False).ids
    assert VOCAB + 1 in good  # </f> is one token
    assert g.matcher().validate(good) == len(good)
    bad = hf.encode('so <f>{"ok": 1}</f>', add_special_tokens=False).ids
    assert g.matcher().validate(bad) < len(bad)
