"""Every extension point a plugin overrides visibly changes what the engine does: the scheduler
builds the plugin's FutureMap (plain and speculative), the verify width from the hook sizes the KV
reserve, the windows, their attention metadata and the captured graphs (with exact output), and
supports_target_verify_for_draft switches the draft worker's mode (or makes asking for it an error)."""

from __future__ import annotations

import pytest
import torch

import spec.registry as registry
from engine.core import ForwardMode, SamplingParams
from engine.engine import Engine, EngineConfig
from engine.worker import PlainExecutor
from engine.future_map import FutureMap
from spec.config import SpecConfig
from spec.eagle_worker import EagleWorker
from spec.ngram import NgramAlgo
from spec.registry import CustomSpecAlgo, SpeculativeAlgorithm, bind, register_class

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121))]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


class RecordingFutureMap(FutureMap):
    """A plugin's own relay: records how it was built and that the engine used it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stashes = 0

    def stash(self, indices, payload) -> None:
        self.stashes += 1
        super().stash(indices, payload)


class PlainWithOwnMap(CustomSpecAlgo):
    built: list[tuple] = []

    def is_speculative(self) -> bool:
        return False

    def needs_draft_model(self) -> bool:
        return False

    def create_future_map(self, max_running_requests, chunked_prefill_size, context_len, device, *, debug=False):
        self.built.append((max_running_requests, chunked_prefill_size, context_len, str(device)))
        return RecordingFutureMap(max_running_requests + 1, device, need_topk=False, need_hidden=False, debug=debug)

    def create_worker(self, parts, config):
        return PlainExecutor(parts.runner, parts.sampler)


class EagleLike(CustomSpecAlgo):
    """A plugin reusing the EAGLE worker; subclasses tweak one hook each."""

    built: list[tuple] = []

    def create_future_map(self, max_running_requests, chunked_prefill_size, context_len, device, *, debug=False):
        self.built.append((max_running_requests, chunked_prefill_size, context_len, str(device)))
        return RecordingFutureMap(max_running_requests + 1, device, need_topk=True, need_hidden=True, debug=debug)

    def build_disagg_draft_input(self, batch, config, last_tokens, future_map):
        return SpeculativeAlgorithm.EAGLE.build_disagg_draft_input(batch, config, last_tokens, future_map)

    def create_worker(self, parts, config):
        return EagleWorker.create(parts, config, "eagle", self)


class WideEagle(EagleLike):
    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens, is_draft_worker):
        return num_draft_tokens + 2


class OldNameWideEagle(EagleLike):
    """Ported from older SGLang: only the deprecated hook name."""

    def get_num_tokens_per_bs_for_target_verify(self, num_draft_tokens, is_draft_worker):
        return num_draft_tokens + 1


class DraftInVerifyShape(EagleLike):
    def supports_target_verify_for_draft(self) -> bool:
        return True

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens, is_draft_worker):
        return num_draft_tokens + (1 if is_draft_worker else 0)


class WideNgram(NgramAlgo):
    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens, is_draft_worker):
        return num_draft_tokens + 3


@pytest.fixture
def plugin():
    """Register a plugin class under a test name; unregistered afterwards."""
    names: list[str] = []

    def add(name: str, cls: type) -> str:
        names.append(name)
        register_class(name, cls)
        return name

    yield add
    for name in names:
        registry.unregister(name)


def _engine(target, spec: SpecConfig | None = None, **kw) -> Engine:
    kw = {"page_size": 4, **kw}
    return Engine(EngineConfig(str(target), **kw), algorithm=bind(spec) if spec else None)


def _want(target) -> list[list[int]]:
    return [o.output_ids for o in _engine(target).generate(PROMPTS, GREEDY)]


def _spy_contexts(runner, mode: ForwardMode) -> list:
    """Contexts of `mode` the runner builds (host-built, and device-built for captured iterations)."""
    seen: list = []
    for name in ("make_context", "window_context"):
        real = getattr(runner, name)

        def spy(m, *a, _real=real, **k):
            ctx = _real(m, *a, **k)
            if m is mode:
                seen.append(ctx)
            return ctx

        setattr(runner, name, spy)
    return seen


def test_scheduler_builds_the_plugins_future_map_for_plain_decoding(pair, plugin) -> None:
    target, _ = pair
    name = plugin("TEST_PLAIN_FM", PlainWithOwnMap)
    PlainWithOwnMap.built.clear()
    eng = _engine(target, SpecConfig(name), overlap=True, max_running=7, chunked_prefill_size=13, max_context_len=200)
    fm = eng.scheduler.future_map
    assert isinstance(fm, RecordingFutureMap) and eng.executor.future_map is fm
    assert PlainWithOwnMap.built == [(7, 13, 200, "cpu")]  # SGLang's argument order
    assert [o.output_ids for o in eng.generate(PROMPTS, GREEDY)] == _want(target)
    assert fm.stashes > 0  # the plain path's next tokens went through the plugin's map


def test_scheduler_builds_the_plugins_future_map_for_speculation(pair, plugin) -> None:
    target, head = pair
    name = plugin("TEST_EAGLE_FM", EagleLike)
    EagleLike.built.clear()
    eng = _engine(target, SpecConfig(name, str(head), 3, 1), overlap=True, future_map_debug=True)
    fm = eng.scheduler.future_map
    assert isinstance(fm, RecordingFutureMap) and eng.executor.future_map is fm
    assert EagleLike.built == [(64, 2048, eng.max_context_len, "cpu")]
    assert [o.output_ids for o in eng.generate(PROMPTS, GREEDY)] == _want(target)
    assert fm.stashes > 0 and fm.rows_free()


@pytest.mark.parametrize(
    "cls,topk,ntok,width",
    [(WideEagle, 1, None, 6), (WideEagle, 2, 5, 7), (OldNameWideEagle, 1, None, 5), (WideNgram, 1, None, 7)],
)
def test_verify_width_from_the_hook_sets_windows_graphs_and_kv(pair, plugin, cls, topk, ntok, width) -> None:
    target, head = pair
    ngram = issubclass(cls, NgramAlgo)
    name = plugin(f"TEST_W_{cls.__name__.upper()}_{topk}", cls)
    spec = SpecConfig(name, None if ngram else str(head), 3, topk, ntok)
    with pytest.warns(DeprecationWarning) if cls is OldNameWideEagle else _nothing():
        eng = _engine(target, spec, cuda_graph_max_bs=4, cuda_graph_padded_eager=True)
    assert eng.scheduler.policy.kv_tokens_per_decode >= width  # KV reserved per decode step
    windows = _spy_contexts(eng.executor.target, ForwardMode.TARGET_VERIFY)
    shapes = eng.executor.target.graph_shapes()
    verify = {(w, bs) for mode, w, bs in shapes if mode is ForwardMode.TARGET_VERIFY}
    assert verify and {w for w, _ in verify} == {width}  # captured at start-up in W-wide shape
    assert [o.output_ids for o in eng.generate(PROMPTS, GREEDY)] == _want(target)  # exact
    assert windows and all(c.extend_lens_cpu == [width] * len(c.extend_lens_cpu) for c in windows)
    assert all(bool((c.qo_indptr.diff() == width).all()) for c in windows)  # attention metadata
    iteration = eng.executor.iteration_graphs if isinstance(eng.executor, EagleWorker) else None
    if iteration is not None:  # a chain: whole iterations, one graph each, at width W
        assert iteration.hits > 0
    else:
        assert eng.executor.target.graph_stats.hits > 0
    assert eng.executor.target.graph_shapes() == shapes  # every verify hit a pre-captured graph


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_target_verify_for_draft_switches_the_draft_workers_mode(pair, plugin) -> None:
    target, head = pair
    name = plugin("TEST_DRAFT_TV", DraftInVerifyShape)
    eng = _engine(target, SpecConfig(name, str(head), 3, 1), cuda_graph_max_bs=4, cuda_graph_padded_eager=True)
    draft = eng.executor.draft
    windows = _spy_contexts(draft, ForwardMode.TARGET_VERIFY)
    modes = {(mode, w) for mode, w, _ in draft.graph_shapes() if w > 1}
    assert modes == {(ForwardMode.TARGET_VERIFY, 5)}  # the hook's draft width, in verify shape
    assert [o.output_ids for o in eng.generate(PROMPTS, GREEDY)] == _want(target)
    assert windows and all(c.extend_lens_cpu[0] == 5 for c in windows)

    plain = _engine(target, SpecConfig("EAGLE", str(head), 3, 1), cuda_graph_max_bs=4, cuda_graph_padded_eager=True)
    modes = {(mode, w) for mode, w, _ in plain.executor.draft.graph_shapes() if w > 1}
    assert modes == {(ForwardMode.DRAFT_EXTEND, 4)}
    with pytest.raises(ValueError, match="supports_target_verify_for_draft"):
        plain.executor.draft.make_context(ForwardMode.TARGET_VERIFY, [1], [0], [4])
    with pytest.raises(ValueError, match="supports_target_verify_for_draft"):
        plain.executor.draft.capture(ForwardMode.TARGET_VERIFY, 4)


def test_identity_queries_are_answered_by_the_algorithm(plugin) -> None:
    A = SpeculativeAlgorithm
    assert A.NONE.is_none() and not A.NONE.is_some() and not A.EAGLE.is_none()
    assert A.EAGLE.is_eagle() and not A.EAGLE.is_eagle3() and A.EAGLE3.is_eagle() and A.EAGLE3.is_eagle3()
    ngram = A.from_name("NGRAM")
    assert ngram.is_ngram() and ngram.is_some() and not ngram.is_eagle() and not ngram.has_draft_kv()
    name = plugin("TEST_IS", EagleLike)
    custom = A.from_name(name)
    assert custom.is_some() and not any(
        getattr(custom, q)() for q in ("is_none", "is_eagle", "is_eagle3", "is_ngram", "is_standalone", "is_dflash")
    )
    assert A.EAGLE.get_num_tokens_per_bs_for_target_verify(4, False) == 4  # SGLang's name, built-ins too
    assert custom.get_num_tokens_per_bs_for_target_verify(6, True) == 6


def test_a_worker_missing_part_of_the_protocol_is_refused(pair, plugin) -> None:
    class Half:
        def step(self, batch, relay):
            raise NotImplementedError

    class HalfAlgo(CustomSpecAlgo):
        def needs_draft_model(self) -> bool:
            return False

        def create_worker(self, parts, config):
            return Half()

    name = plugin("TEST_HALF", HalfAlgo)
    with pytest.raises(TypeError, match="missing .*launch"):
        _engine(pair[0], SpecConfig(name))


def test_unpublished_row_is_caught_in_a_live_engine_by_default(pair) -> None:
    target, head = pair
    eng = _engine(target, SpecConfig("EAGLE", str(head), 3, 1), overlap=True)
    assert not eng.scheduler.future_map.debug
    req = eng.make_request(PROMPTS[0], GREEDY, "victim")
    eng.io.submit(req)
    while not req.output_ids:
        eng.step()
    eng.scheduler.future_map.invalidate(torch.tensor([req.slot]))
    ended = [d for _ in range(5) for d in eng.step() if d.finished]
    # caught on its first read: that request fails alone (engine.scheduler isolates failures)
    assert [d.rid for d in ended] == ["victim"] and "read before being written" in ended[0].finish_detail
    assert eng.scheduler.stats["failed_steps"] == 1 and eng.kv.all_free
