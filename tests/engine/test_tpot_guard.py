"""The TPOT guard: prompt chunks run between decode steps when the decoding requests' slack pays for
them (tokens and the batch's fixed part), and the output is what the node gives without the guard
(plain, EAGLE, n-gram; chunked prompts that arrive while others decode); every page returns."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.core import ForwardMode, Req, SamplingParams
from engine.engine import Engine, EngineConfig
from engine.scheduler.tpot_guard import HORIZON, MIN_CHUNK, STARVE_STEPS, UNMEASURED_CHUNK, TpotGuard
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
EARLY = [[5, 17, 42, 7, 99, 3, 11, 250], [8, 1]]
LATE = [list(range(100, 141)), [300, 301, 302] * 9]  # 41 and 27 tokens: several chunks each


@dataclass
class FixedRates:
    prefill: float
    step: float | None
    per_step: float = 1.0
    overhead: float = 0.0
    mixed: float = 0.0

    def prefill_tokens_per_s(self) -> float:
        return self.prefill

    def prompt_overhead_s(self) -> float:
        return self.overhead

    def decode_step_s(self, batch_size: int) -> float | None:
        return None if self.step is None else self.step * (1 + batch_size / 100)

    def decode_tokens_per_step(self) -> float:
        return self.per_step

    def mixed_tokens_per_s(self) -> float:
        return self.mixed


def _req(rid: str, produced: int, max_new: int = 100) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=max_new))
    req.output_ids = list(range(produced))
    return req


def test_a_chunk_spends_the_smallest_slack_of_the_decoding_requests():
    # 25 ms per token, an 8.08 ms step at batch 1: each future token earns 16.92 ms, and a request
    # first seen now may spend 16 of them (the horizon); the chunk's fixed part is 5 ms
    guard = TpotGuard(0.025, FixedRates(10_000, 0.008, overhead=0.005), 8192)
    fresh = _req("a", 0)
    assert guard.chunk_tokens([fresh], want=5000, now=100.0) == int((HORIZON * 0.01692 - 0.005) * 10_000)
    # one second later it has gained 10 tokens: 250 ms earned, 1 s spent: nothing to spend
    fresh.output_ids = list(range(10))
    assert guard.chunk_tokens([fresh], want=5000, now=101.0) == 0
    # the smallest slack decides: a request on budget beside it changes nothing
    on_budget = _req("b", 0)
    assert guard.chunk_tokens([fresh, on_budget], want=5000, now=101.0) == 0
    # a request near its end has few tokens left to earn with
    guard = TpotGuard(0.025, FixedRates(10_000, 0.008, overhead=0.005), 8192)
    assert guard.chunk_tokens([_req("c", 98)], want=5000, now=0.0) == int((2 * 0.01692 - 0.005) * 10_000)


def test_chunks_are_worth_their_fixed_part_and_a_prompt_never_starves():
    rates = FixedRates(10_000, 0.008, overhead=0.030)
    guard = TpotGuard(0.025, rates, 512)
    # never more than the node's chunk size
    assert TpotGuard(0.025, FixedRates(1e6, 0.008), 512).chunk_tokens([_req("a", 0)], want=5000, now=0.0) == 512
    # a slack that pays 34 tokens beside the 30 ms fixed part: too small for a long prompt...
    ahead = _req("a", 98)  # two tokens left: 33.84 ms to spend
    assert guard.chunk_tokens([ahead], want=5000, now=0.0) == 0
    # ...enough to finish a short one
    assert guard.chunk_tokens([ahead], want=30, now=0.0) == 38
    # a step already over the budget earns nothing: after STARVE_STEPS refusals, MIN_CHUNK anyway
    slow = TpotGuard(0.025, FixedRates(10_000, 0.030), 8192)
    got = [slow.chunk_tokens([_req("s", 0)], want=5000, now=0.0) for _ in range(STARVE_STEPS + 1)]
    assert got == [0] * STARVE_STEPS + [MIN_CHUNK]
    # nothing measured yet: a small fixed chunk
    assert TpotGuard(0.025, FixedRates(0.0, None), 8192).chunk_tokens([_req("a", 0)], 50) == UNMEASURED_CHUNK
    assert TpotGuard(0.025, FixedRates(0.0, None), 64).chunk_tokens([_req("a", 0)], 50) == 64


def test_the_guard_forgets_requests_that_stopped_decoding():
    guard = TpotGuard(0.025, FixedRates(10_000, 0.008), 8192)
    guard.chunk_tokens([_req("a", 0), _req("b", 0)], want=100, now=0.0)
    guard.chunk_tokens([_req("b", 3)], want=100, now=0.1)
    assert set(guard._since) == {"b"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    target = write_tiny_model(root / "t", seed=1)
    return target, write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat")


SPECS = {
    "plain": None,
    "eagle": ("EAGLE", 3),
    "ngram": ("NGRAM", 3),
}


def make_engine(models, spec, **kw) -> Engine:
    target, head = models
    binding = None
    if SPECS[spec] is not None:
        algo, steps = SPECS[spec]
        binding = bind(SpecConfig(algo, str(head) if algo == "EAGLE" else None, steps))
    cfg = EngineConfig(str(target), page_size=4, chunked_prefill_size=8, future_map_debug=True, **kw)
    return Engine(cfg, algorithm=binding)


def staggered(eng: Engine) -> tuple[list[list[int]], list[ForwardMode], list[bool]]:
    """Two prompts start decoding, then two longer ones arrive; returns outputs, the batch modes and
    whether requests were decoding when each batch formed."""
    modes: list[ForwardMode] = []
    decoding: list[bool] = []
    policy = eng.scheduler.policy
    form = policy.next_batch

    def spy(on_admit, on_retract):
        decoding.append(bool(policy._decoding()))
        batch = form(on_admit, on_retract)
        modes.append(batch.mode)
        return batch

    policy.next_batch = spy  # type: ignore[method-assign]
    early = [eng._submit(p, GREEDY) for p in EARLY]
    outs: dict[str, list[int]] = {r.rid: [] for r in early}
    for _ in range(3):
        for d in eng.step():
            outs[d.rid].extend(d.token_ids)
    late = [eng._submit(p, GREEDY) for p in LATE]
    outs.update({r.rid: [] for r in late})
    while eng.scheduler.has_work:
        for d in eng.step():
            outs[d.rid].extend(d.token_ids)
    assert eng.kv.all_free
    eng.kv.check()
    return [outs[r.rid] for r in early + late], modes, decoding


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_guarded_prompts_alternate_with_decode_steps_and_change_no_token(models, spec, overlap):
    want, free_modes, _ = staggered(make_engine(models, spec, overlap=overlap))
    got, modes, decoding = staggered(make_engine(models, spec, overlap=overlap, tpot_guard_ms=25.0))
    assert got == want
    assert all(len(o) == GREEDY.max_new_tokens for o in got)
    extend = ForwardMode.EXTEND
    # with requests decoding, never two prompt chunks in a row
    assert not any(a is extend and b is extend and busy for a, b, busy in zip(modes, modes[1:], decoding[1:]))
    # without the guard the late prompts ran chunk after chunk
    assert any(a is extend and b is extend for a, b in zip(free_modes, free_modes[1:]))


def test_batches_are_timed_into_the_node_rates(models):
    eng = make_engine(models, "plain")
    eng.generate(EARLY + LATE, GREEDY)
    rates = eng.rates
    assert rates.prefill_tokens_per_s() > 0
    assert rates.decode_tokens_per_step() == pytest.approx(1.0)
    assert rates.step_times() and all(s > 0 for s in rates.step_times().values())
    snap = rates.snapshot(eng.config.max_running)
    assert snap["decode_capacity_tokens_per_s"] > 0 and set(snap["decode_step_s"]) <= {"1", "2", "4"}
    assert rates.recent_decode_tokens_per_s() > 0 and rates.recent_prompt_tokens_per_s() > 0
