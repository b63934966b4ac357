"""The FutureMap inside the overlapped EAGLE loop: publish/stash/resolve order per row, poison
detection of an unpublished read, and PD seeding while a forward is in flight."""

from __future__ import annotations

import pytest
import torch

from engine.core import Batch, ForwardMode, SamplingParams
from engine.engine import Engine, EngineConfig
from spec.config import SpecConfig
from engine.future_map import FutureMap
from spec.registry import SpeculativeAlgorithm, bind
from tests.spec.handoff import hand_off

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121))]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


def _engine(pair, topk=2, ntok=5, **kw) -> tuple[Engine, SpecConfig]:
    cfg = SpecConfig("EAGLE", str(pair[1]), 3, topk, ntok)
    kw = {"page_size": 4, "overlap": True, "future_map_debug": True, **kw}
    return Engine(EngineConfig(str(pair[0]), **kw), algorithm=bind(cfg)), cfg


def _trace(fm: FutureMap) -> list[tuple[str, tuple[int, ...]]]:
    log: list[tuple[str, tuple[int, ...]]] = []
    for name in ("publish", "stash", "resolve_seq_lens", "resolve", "invalidate"):
        real = getattr(fm, name)

        def traced(indices, *a, _real=real, _name=name, **k):
            log.append((_name, tuple(int(i) for i in indices.tolist())))
            return _real(indices, *a, **k)

        setattr(fm, name, traced)
    return log


def _assert_fails_alone(eng: Engine, rid: str) -> None:
    """The guard fires on the request's first read: it fails alone, and everything returns."""
    ended = [d for _ in range(6) for d in eng.step() if d.finished]
    assert [d.rid for d in ended] == [rid] and "read before being written" in ended[0].finish_detail
    while not eng.idle:
        eng.step()
    assert eng.scheduler.stats["failed_steps"] == 1 and eng.kv.all_free


def test_relay_order_per_row_in_the_overlapped_loop(pair):
    eng, _ = _engine(pair)
    log = _trace(eng.executor.future_map)
    outs = eng.generate(PROMPTS, GREEDY)
    assert all(len(o.output_ids) == 20 for o in outs)
    rows = {r for _, idx in log for r in idx}
    for row in rows:
        seq = [name for name, idx in log if row in idx]
        # prefill end: publish (before draft-extend) then stash; each decode: resolve lengths and
        # payload, publish between verify and draft-extend, stash after; release: invalidate
        assert seq[:2] == ["publish", "stash"], seq
        body, tail = seq[2:-1], seq[-1]
        assert tail == "invalidate" and len(body) % 4 == 0 and body, seq
        for i in range(0, len(body), 4):
            assert body[i : i + 4] == ["resolve_seq_lens", "resolve", "publish", "stash"], seq
    assert eng.kv.all_free and eng.executor.future_map.rows_free()


def test_reading_an_unpublished_row_is_detected(pair):
    eng, _ = _engine(pair)
    req = eng.make_request(PROMPTS[0], GREEDY, "victim")
    eng.io.submit(req)
    while not req.output_ids:
        eng.step()
    # the row holds the prefill's publish + stash; drop them as a missed publish would
    eng.executor.future_map.invalidate(torch.tensor([req.slot]))
    _assert_fails_alone(eng, "victim")


def test_production_map_guards_unpublished_reads(pair):
    eng, _ = _engine(pair, future_map_debug=False)
    fm = eng.executor.future_map
    assert not fm.debug and fm is eng.scheduler.future_map
    assert int(fm.output_tokens_buf.min()) == -1  # unwritten rows hold the sentinel
    req = eng.make_request(PROMPTS[0], GREEDY, "victim")
    eng.io.submit(req)
    while not req.output_ids:
        eng.step()
    fm.invalidate(torch.tensor([req.slot]))  # as a missed publish would leave it
    _assert_fails_alone(eng, "victim")


@pytest.mark.parametrize("topk,ntok", [(1, 4), (2, 5)])
def test_pd_seeding_while_a_forward_is_in_flight(pair, topk, ntok):
    colo, _ = _engine(pair, topk, ntok)
    want = {f"r{i}": o.output_ids for i, o in enumerate(colo.generate(PROMPTS, GREEDY))}
    prefill, _ = _engine(pair, topk, ntok)
    decode, cfg = _engine(pair, topk, ntok)
    algo = SpeculativeAlgorithm.from_name("EAGLE")
    fm = decode.executor.future_map
    got: dict[str, list[int]] = {}
    decode.add_request(PROMPTS[0], GREEDY, rid="r0")  # colocated on the decode engine itself
    for i, prompt in enumerate(PROMPTS[1:], start=1):
        for _ in range(3):  # r0 is decoding: a batch of it is in flight when the next one joins
            for d in decode.step():
                got.setdefault(d.rid, []).extend(d.token_ids)
        assert decode.scheduler._inflight is not None
        req = hand_off(prefill, decode, prompt, f"r{i}", GREEDY)
        # seeded by the algorithm right away (SGLang's call shape), then adopted
        di = algo.build_disagg_draft_input(
            Batch(ForwardMode.PREBUILT, [req]), cfg, torch.tensor(req.output_ids[-1:]), fm
        )
        for u in decode.scheduler.adopt_prebuilt([req], di):
            got.setdefault(u.rid, []).extend(u.tokens)
    while not decode.idle:
        for d in decode.step():
            got.setdefault(d.rid, []).extend(d.token_ids)
    assert got == want
    assert decode.kv.all_free and prefill.kv.all_free and fm.rows_free()
