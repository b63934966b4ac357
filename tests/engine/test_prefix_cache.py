"""The prefix cache in the engine: a conversation's later turns and requests sharing a system
prompt reuse cached pages, and greedy output and accepted drafts equal the cache-off run (plain,
EAGLE, EAGLE-3, n-gram; chunked prefill; overlap on and off); under memory pressure the cache
gives way and nothing is refused; every page is accounted for."""

from __future__ import annotations

import pytest

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(200, 237))  # 37 tokens shared by every request of the second workload


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    target = write_tiny_model(root / "t", seed=1)
    return {
        "target": target,
        "eagle": write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat"),
        "eagle3": write_tiny_eagle_head(root / "h3", target, "eagle3", mode="random", draft_vocab_size=300),
    }


SPECS = {
    "plain": None,
    "eagle": ("EAGLE", "eagle", 3, 1, None),
    "eagle_tree": ("EAGLE", "eagle", 3, 2, 5),
    "eagle3": ("EAGLE3", "eagle3", 3, 2, 5),
    "ngram": ("NGRAM", None, 3, 1, None),
}


def make_engine(models, spec: str, cache: bool, **kw) -> Engine:
    binding = None
    if SPECS[spec] is not None:
        algo, head, steps, topk, ntok = SPECS[spec]
        binding = bind(SpecConfig(algo, str(models[head]) if head else None, steps, topk, ntok))
    kw = {"page_size": 4, "chunked_prefill_size": 16, "future_map_debug": True, "radix_cache": cache, **kw}
    return Engine(EngineConfig(str(models["target"]), **kw), algorithm=binding)


def conversation(eng: Engine, turns: int = 4) -> list[tuple[list[int], int]]:
    """Each turn's prompt is the whole history (prompts and replies) plus a new message."""
    history: list[int] = []
    outs = []
    for t in range(turns):
        history = history + [17 + t, 42, 7 * t + 3, 99, 250 - t]
        out = eng.generate([history], GREEDY)[0]
        outs.append((out.output_ids, sum(out.accepted_drafts)))
        history = history + out.output_ids
    return outs


def shared_system_prompt(eng: Engine) -> list[tuple[list[int], int]]:
    first = eng.generate([SYSTEM + [1, 2, 3]], GREEDY)  # the prefix gets cached
    rest = eng.generate([SYSTEM + [i, i + 5, 9] for i in range(4, 10)], GREEDY)  # together
    return [(o.output_ids, sum(o.accepted_drafts)) for o in first + rest]


def settle(eng: Engine) -> None:
    assert eng.kv.all_free
    eng.kv.check()
    cache = eng.kv.cache
    if cache is not None:
        cache.clear()
        assert eng.kv.allocator.num_used == 0 and cache.num_pages == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_hits_change_no_token_and_no_acceptance(models, spec, overlap):
    results = {}
    for cache in (False, True):
        eng = make_engine(models, spec, cache, overlap=overlap)
        results[cache] = (conversation(eng), shared_system_prompt(eng))
        if cache:
            assert eng.kv.cache.stats["matched_tokens"] >= 100  # later turns and the shared prompt hit
        settle(eng)
    assert results[True] == results[False]


def test_pressure_evicts_cached_pages_and_refuses_nothing(models):
    # 40 pages of 4 tokens: a few requests' worth; many distinct prompts leave far more cached
    for spec in ("plain", "eagle"):
        small = {"max_total_tokens": 160, "max_running": 4}
        prompts = [[(7 * i + j) % 500 + 1 for j in range(20 + i % 9)] for i in range(24)]
        want = make_engine(models, spec, False, **small).generate(prompts, GREEDY)
        eng = make_engine(models, spec, True, **small)
        got = eng.generate(prompts, GREEDY)
        again = eng.generate(prompts[-3:], GREEDY)  # the most recent ones are still cached
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
        assert [o.output_ids for o in again] == [o.output_ids for o in want[-3:]]
        assert all(o.finish_reason == "length" for o in got + again)
        assert eng.kv.cache.stats["evicted_pages"] > 0 and eng.kv.cache.stats["matched_tokens"] > 0
        settle(eng)
