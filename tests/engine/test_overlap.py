"""Overlap scheduling: overlap on == off token for token (plain, EAGLE chain/tree, EAGLE-3; greedy
and seeded; page sizes 1 and 4; chunked prefill), results one step late, nothing leaks."""

from __future__ import annotations

import pytest
import torch

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [8, 1], list(range(100, 121)), [300] * 5]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=True)
MIXED = [GREEDY, SEEDED, GREEDY, SamplingParams(max_new_tokens=17, temperature=0.7, seed=3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    target = write_tiny_model(root / "t", seed=1)
    return {
        "target": target,
        "eagle": write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat"),
        "eagle3": write_tiny_eagle_head(root / "h3", target, "eagle3", mode="random", draft_vocab_size=300),
    }


def make_engine(models, spec=None, **kw) -> Engine:
    kw = {"page_size": 4, "chunked_prefill_size": 7, "future_map_debug": True, **kw}
    binding = None
    if spec is not None:
        algo, steps, topk, ntok = spec
        head = models["eagle3" if algo == "EAGLE3" else "eagle"]
        binding = bind(SpecConfig(algo, str(head), steps, topk, ntok))
    return Engine(EngineConfig(str(models["target"]), **kw), algorithm=binding)


def assert_all_returned(eng: Engine) -> None:
    """Every KV page and request slot is free, and (debug FutureMap) every relay row was
    consumed or invalidated on release."""
    assert not eng.scheduler.has_work
    assert eng.kv.all_free
    eng.kv.check()
    fm = getattr(eng.executor, "future_map", None)
    if fm is not None:
        assert fm.rows_free()


def run(models, spec=None, params=MIXED, **kw):
    eng = make_engine(models, spec, **kw)
    outs = eng.generate(PROMPTS, params)
    assert_all_returned(eng)
    return [(o.output_ids, o.logprobs) for o in outs], eng


@pytest.fixture(scope="module")
def plain_greedy(models):
    outs, _ = run(models, params=GREEDY, page_size=1)
    return [o for o, _ in outs]


CASES = [  # speculative (algo, steps, topk, draft tokens) or None, page size
    (None, 1),
    (None, 4),
    (("EAGLE", 3, 1, None), 4),
    (("EAGLE", 3, 2, 5), 1),
    (("EAGLE3", 3, 2, 5), 4),
]


@pytest.mark.parametrize("spec,page_size", CASES)
def test_overlap_equals_sync_token_for_token(models, plain_greedy, spec, page_size):
    sync, _ = run(models, spec, page_size=page_size)
    over, eng = run(models, spec, page_size=page_size, overlap=True)
    assert eng.scheduler.overlap
    for (a, la), (b, lb) in zip(sync, over):
        assert a == b
        assert la == pytest.approx(lb, abs=1e-5)
    # greedy rows equal plain greedy decoding (speculative or not, overlapped or not)
    assert [over[0][0], over[2][0]] == [plain_greedy[0][:24], plain_greedy[2][:24]]


def test_launch_runs_one_batch_ahead_of_collect(models):
    eng = make_engine(models, overlap=True)
    log: list[tuple[str, int]] = []
    batches: list = []  # kept alive so identities stay unique
    launch, collect = eng.executor.launch, eng.executor.collect

    def traced_launch(batch, relay):
        batches.append(batch)
        log.append(("launch", len(batches) - 1))
        return launch(batch, relay)

    def traced_collect(handle):
        log.append(("collect", next(i for i, b in enumerate(batches) if b is handle.batch)))
        return collect(handle)

    eng.executor.launch, eng.executor.collect = traced_launch, traced_collect
    eng.generate(PROMPTS[:2], GREEDY)
    # L0 L1 C0 L2 C1 ...: every batch but the first is launched before the previous is collected
    n = len(batches)
    want = [("launch", 0)] + [e for i in range(1, n) for e in (("launch", i), ("collect", i - 1))]
    assert n > 10 and log == want + [("collect", n - 1)]
    assert_all_returned(eng)


def test_stop_token_in_batch_n_discards_batch_n_plus_1(models, plain_greedy):
    # stop request 0 at its 6th token: under overlap it is already in the next batch
    stop = plain_greedy[0][5]
    params = [SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=(stop,))] + [GREEDY] * 3
    for spec in (None, ("EAGLE", 3, 2, 5)):
        sync, _ = run(models, spec, params)
        over, eng = run(models, spec, params, overlap=True)
        assert sync == over
        assert over[0][0][-1] == stop and len(over[0][0]) <= 6
        assert eng.scheduler.stats["discarded"] > 0


def scripted(models, spec, overlap: bool, **kw) -> tuple[dict[str, list[int]], Engine]:
    """Late arrivals and aborts at fixed steps; returns the outputs of requests that ran to the end."""
    eng = make_engine(models, spec, overlap=overlap, **kw)
    arrivals = {0: [0, 1], 2: [2], 5: [3, 0], 9: [2, 1]}  # step -> prompt indices
    aborts = {4: "r1", 12: "r5"}
    got: dict[str, list[int]] = {}
    done: dict[str, str] = {}
    n = 0
    for step in range(400):
        for i in arrivals.get(step, []):
            eng.add_request(PROMPTS[i], MIXED[i], rid=f"r{n}")
            n += 1
        if step in aborts:
            eng.abort(aborts[step])
        for d in eng.step():
            got.setdefault(d.rid, []).extend(d.token_ids)
            if d.finished:
                done[d.rid] = d.finish_reason.value
        if step > max(arrivals) and eng.idle:
            break
    assert len(done) == n
    return {rid: toks for rid, toks in got.items() if done[rid] != "abort"}, eng


@pytest.mark.parametrize("spec", [None, ("EAGLE", 3, 2, 5)])
def test_late_arrivals_aborts_and_retraction(models, spec):
    # a pool this small forces retractions; requests aborted mid-flight discard their results
    kw = {"max_total_tokens": 64, "page_size": 4}
    sync, eng_s = scripted(models, spec, False, **kw)
    over, eng_o = scripted(models, spec, True, **kw)
    assert sync.keys() == over.keys() and len(over) >= 4
    if spec is not None:
        # A retracted request re-extends, so its next drafts come from a prefill draft-extend
        # instead of the decode one: rejection sampling stays distribution-exact but draws
        # differently. Where retractions fall depends on the schedule, so under speculation only
        # greedy requests (r0 r2 r4: prompts 0 and 2) are schedule-independent token for token.
        sync = {k: v for k, v in sync.items() if k in ("r0", "r2", "r4")}
        over = {k: v for k, v in over.items() if k in ("r0", "r2", "r4")}
    assert sync == over
    assert eng_o.scheduler.stats["retractions"] > 0 and eng_s.scheduler.stats["retractions"] > 0
    assert eng_o.scheduler.stats["discarded"] > 0  # e.g. r1, aborted while its batch ran
    for eng in (eng_s, eng_o):
        assert_all_returned(eng)


def test_executor_that_cannot_overlap_runs_synchronously(models, plain_greedy):
    from spec.ngram import NgramAlgo
    from spec.registry import register_class

    register_class("NGRAM", NgramAlgo)  # normally its entry point; a no-op when that loaded it
    eng = Engine(
        EngineConfig(str(models["target"]), page_size=4, overlap=True), algorithm=bind(SpecConfig("NGRAM", num_steps=3))
    )
    assert not eng.executor.supports_overlap() and not eng.scheduler.overlap
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == [p[:24] for p in plain_greedy]
    assert_all_returned(eng)


@pytest.mark.parametrize("spec", [None, ("EAGLE", 3, 2, 5)])
def test_a_failed_launch_with_a_batch_in_flight_fails_only_its_cause(models, spec):
    want = [o.output_ids for o in make_engine(models, spec, overlap=True).generate(PROMPTS, GREEDY)]
    eng = make_engine(models, spec, overlap=True)
    launch, calls = eng.executor.launch, []

    def flaky(batch, relay):
        calls.append(batch)
        if len(calls) == 6:
            assert eng.scheduler._inflight is not None  # batch 5 is in flight when batch 6 fails
            raise RuntimeError("boom")
        return launch(batch, relay)

    eng.executor.launch = flaky
    outs = eng.generate(PROMPTS, GREEDY)
    assert eng.scheduler.stats["failed_steps"] == 1
    failed = calls[5].reqs
    for o, w in zip(outs, want):
        if len(failed) == 1 and o.rid == failed[0].rid:  # alone in the failed batch: the cause
            assert o.finish_reason.value == "abort" and "boom" in o.finish_detail
        else:  # the batch in flight and the failed batch's members re-run alone: exact
            assert o.output_ids == w
    assert_all_returned(eng)
    eng.executor.launch = launch  # the engine goes on serving
    assert len(eng.generate(PROMPTS[:1], GREEDY)[0].output_ids) == 24
    assert_all_returned(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [None, ("EAGLE", 3, 1, None), ("EAGLE", 3, 2, 5)])
def test_overlap_equals_sync_on_cuda(models, spec):
    """Real asynchrony: pinned non_blocking result copies, events, the FutureMap's publish event
    and its asynchronous poison check (debug mode) on a CUDA stream."""
    sync, _ = run(models, spec, device="cuda")
    over, eng = run(models, spec, device="cuda", overlap=True)
    assert eng.scheduler.overlap
    for (a, la), (b, lb) in zip(sync, over):
        assert a == b
        assert la == pytest.approx(lb, abs=1e-4)
    torch.cuda.synchronize()  # surfaces a failed asynchronous FutureMap check, if any


@pytest.mark.gpu
def test_overlap_with_triton_and_cuda_graphs(models):
    pytest.importorskip("triton")
    kw = {"device": "cuda", "attention_backend": "triton", "cuda_graph_max_bs": 8}
    for spec in (None, ("EAGLE", 3, 2, 5)):
        sync, _ = run(models, spec, params=GREEDY, **kw)
        over, _ = run(models, spec, params=GREEDY, overlap=True, **kw)
        assert [a for a, _ in sync] == [b for b, _ in over]
    torch.cuda.synchronize()


def test_a_held_prompts_chunk_progress_leaves_when_the_chunk_is_launched(models):
    """Under overlap a batch is collected only after the next one was launched; a prompt chunk's
    KV progress (pages final once its fence is reached) goes out at its launch, so the last
    non-final chunk's pages can leave while the final chunk runs."""
    eng = make_engine(models, overlap=True)  # 7-token chunks, 4-token pages
    events: list[tuple[str, object]] = []
    finals: list[tuple[int, ...] | None] = []
    launch, publish = eng.executor.launch, eng.scheduler.io.publish

    def launched(batch, relay):
        events.append(("launch", batch.extend_lens[0]))
        return launch(batch, relay)

    def published(updates):
        events.extend(("progress", u.kv_progress.pages) for u in updates if u.kv_progress is not None)
        finals.extend(u.held_pages for u in updates if u.finished)
        publish(updates)

    eng.executor.launch, eng.scheduler.io.publish = launched, published
    held = eng.make_request(list(range(10, 40)), SamplingParams(max_new_tokens=1, temperature=0.0), "held")
    held.hold_kv = True
    eng.io.submit(held)
    while not held.output_ids:
        eng.step()
    pages = eng.kv.page_list(held)
    assert finals == [tuple(pages)]  # the finishing update names every page: no round trip to ship them
    # 30 tokens in chunks of 7, 7, 7, 7, 2: after each non-final launch, the full pages so far
    assert events == [
        ("launch", 7),
        ("progress", tuple(pages[:1])),
        ("launch", 7),
        ("progress", tuple(pages[:3])),
        ("launch", 7),
        ("progress", tuple(pages[:5])),
        ("launch", 7),
        ("progress", tuple(pages[:7])),
        ("launch", 2),
    ]
    # every launch was timed, as a prompt batch (the node's pdserve_node_launch_seconds)
    prompt_launches, total = eng.scheduler.launch_time.by_kind["prompt"].snapshot()
    assert prompt_launches[-1][1] == 5 and total > 0
    # and every batch collected so far was charged its time (pdserve_node_step_seconds)
    prompt_steps, charged = eng.rates.step_time.by_kind["prompt"].snapshot()
    assert 4 <= prompt_steps[-1][1] <= 5 and charged > 0
    eng.scheduler.release_kv(held)
