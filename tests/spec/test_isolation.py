"""One request's failure stays its own: a request that makes every step it is in fail (a poisoned
request) fails alone, with the error; its neighbours finish exactly as they would have; nothing
leaks; plain and speculative, overlap off and on."""

from __future__ import annotations

import pytest

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from spec.config import SpecConfig
from spec.registry import bind

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121)), [8, 1, 9]]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


def _engine(pair, spec: bool, overlap: bool) -> Engine:
    target, head = pair
    binding = bind(SpecConfig("EAGLE", str(head), 3, 1)) if spec else None
    return Engine(EngineConfig(str(target), page_size=4, overlap=overlap, future_map_debug=True), algorithm=binding)


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_poisoned_request_fails_alone(pair, spec: bool, overlap: bool) -> None:
    want = [o.output_ids for o in _engine(pair, spec, overlap).generate(PROMPTS, GREEDY)]
    eng = _engine(pair, spec, overlap)
    launch = eng.executor.launch
    poisoned = {"steps": 0}

    def poisonous(batch, relay):
        if any(r.rid == "poison" for r in batch.reqs) and batch.mode.name == "DECODE":
            poisoned["steps"] += 1
            raise IndexError("index 1024 is out of bounds for dimension 0 with size 1024")
        return launch(batch, relay)

    eng.executor.launch = poisonous
    eng.executor.step = lambda batch, relay: eng.executor.collect(poisonous(batch, relay))
    rids = [eng.add_request(p, GREEDY) for p in PROMPTS[:2]]
    rids.append(eng.add_request([11, 12, 13, 14], GREEDY, rid="poison"))
    rids += [eng.add_request(p, GREEDY) for p in PROMPTS[2:]]
    got: dict[str, list[int]] = {r: [] for r in rids}
    ended: dict[str, object] = {}
    while len(ended) < len(rids):
        for d in eng.step():
            got[d.rid].extend(d.token_ids)
            if d.finished:
                ended[d.rid] = d
    assert ended["poison"].finish_reason.value == "abort" and "out of bounds" in ended["poison"].finish_detail
    assert [got[r] for r in rids if r != "poison"] == want  # the neighbours: untouched, exact
    assert poisoned["steps"] == 2  # once with its batch, once alone
    while not eng.idle:
        eng.step()
    assert eng.kv.all_free and eng.scheduler.future_map.rows_free()
