"""Conformance kit for speculative algorithms: one call a plugin author runs in their own tests.

`check_algorithm(SpecConfig(...), target_dir)` drives the algorithm through colocated decoding
(overlap off and on), CUDA-graph shaped forwards (the padded static-buffer path, run eagerly on a
CPU), PD over the in-process transport (prefill engine -> handoff row + KV pages over the fake
transport -> decode engine, through the same facade, codec and `build_disagg_draft_input` a
decode node uses), an empty PREBUILT batch, a handoff with missing state, and prompts that end
within a window of the context limit (greedy and sampled, overlap off and on, colocated and PD).
It checks that greedy output equals plain decoding everywhere, that PD acceptance equals
colocated acceptance, that generation runs to the context limit and ends there with `length`,
and that every KV page, FutureMap row and handoff row returns to its pool. Any failure raises
ConformanceError naming the check.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.core import Req, SamplingParams
from engine.disagg import DisaggEngine
from engine.engine import Engine, EngineConfig
from engine.grammar.compiler import new_matcher
from engine.kv_transfer import FakeTransport, HandoffRows, TransferRequest, parse_tag
from spec.config import SpecConfig
from spec.draft_input import DisaggHandoffError
from spec.registry import AlgorithmBinding, bind

_names = itertools.count()


class ConformanceError(AssertionError):
    """A conformance check failed; the message names the check and what differed."""


@dataclass
class Outcome:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ConformanceReport:
    algorithm: str
    checks: list[str] = field(default_factory=list)  # the checks that passed, in order
    mean_accept_len: float = 0.0


def default_prompts(vocab_size: int, n: int = 3, seed: int = 0) -> list[list[int]]:
    """A repetitive prompt (history-based drafts accept on it) and random ones."""
    rng = random.Random(seed)
    cycle = [rng.randrange(3, vocab_size) for _ in range(5)]
    out = [cycle * 4]
    out += [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(4, 22))] for _ in range(n - 1)]
    return out


def _run(engine: Engine, prompts: Sequence[list[int]], params: SamplingParams) -> Outcome:
    res = Outcome()
    for i, o in enumerate(engine.generate(list(prompts), params)):
        res.tokens[f"r{i}"], res.accepted[f"r{i}"] = o.output_ids, o.accepted_drafts
    return res


def _expect(ok: bool, check: str, detail: str) -> None:
    if not ok:
        raise ConformanceError(f"{check}: {detail}")


def _assert_returned(engine: Engine, check: str) -> None:
    _expect(not engine.scheduler.has_work, check, "the engine still has work after every request ended")
    engine.kv.check()
    _expect(engine.kv.all_free, check, f"{engine.kv.num_held} KV pages still in use")
    _expect(engine.scheduler.future_map.rows_free(), check, "FutureMap rows not released")


class InProcessPD:
    """A prefill and a decode engine in one process, joined by the fake transport: the PD path of
    the nodes (facade, handoff rows, codec, build_disagg_draft_input) without processes."""

    def __init__(self, prefill: Engine, decode: Engine, binding: AlgorithmBinding, rows: int = 16) -> None:
        self.prefill, self.decode, self.binding = prefill, decode, binding
        self.pd_p, self.pd_d = DisaggEngine(prefill), DisaggEngine(decode)
        n = next(_names)
        self.rows_p = HandoffRows(self.pd_p.handoff_bytes, rows)
        self.rows_d = HandoffRows(self.pd_d.handoff_bytes, rows)
        self.t_p = FakeTransport(f"conformance-prefill-{n}", self.pd_p.kv_pools(), self.rows_p)
        self.t_d = FakeTransport(f"conformance-decode-{n}", self.pd_d.kv_pools(), self.rows_d)
        self.t_p.add_peer(self.t_d.metadata(), self.t_d.layout())
        self._room = 0
        self._headers: dict[str, Any] = {}  # rid -> handoff header, until adopted

    def close(self) -> None:
        self.t_p.close()
        self.t_d.close()

    def hand_off(self, prompt: list[int], rid: str, params: SamplingParams) -> Req:
        """Prefill `prompt`, move its KV and handoff row, and return the decode side's request,
        decoded (`Req.handoff` set) but not adopted yet."""
        src = self.pd_p.make_request(prompt, dataclasses.replace(params, max_new_tokens=1, stop=()), rid)
        src.hold_kv = True
        _attach_grammar(self.pd_p, src)  # the prefill samples the first token under the grammar
        self.prefill.io.submit(src)
        while not src.output_ids:
            self.prefill.step()
        req = self.pd_d.make_request(prompt, params, rid)
        _attach_grammar(self.pd_d, req)  # a fresh matcher: adoption replays the first token into it
        if not self.pd_d.reserve_prompt(req).result():
            raise ConformanceError(f"PD: the decode engine has no room for {rid}")
        self._room += 1
        row_p, row_d = self.rows_p.alloc(), self.rows_d.alloc()
        assert row_p is not None and row_d is not None
        self.rows_p.write(row_p, self._room, self.pd_p.encode_handoff(src))
        pages = self.pd_p.page_list(src).result()[: self.pd_p.pages_for(src.seq_len)]
        self.t_p.write(
            TransferRequest(self._room, self.t_d.name, pages, self.pd_d.page_list(req).result(), row_p, row_d)
        )
        done = [parse_tag(m) for _, m in self.t_d.drain_notifications()]
        _expect(("done", self._room, "") in done, "PD", f"no completion for room {self._room}: {done}")
        echo, payload = self.rows_d.read(row_d)
        _expect(echo == self._room, "PD", f"row echo {echo} != room {self._room}")
        self.rows_p.free(row_p)
        self.rows_d.free(row_d)
        self.pd_p.release(src).result()
        header, state = self.pd_d.decode_handoff(payload)
        req.output_ids, req.seq_len, req.handoff = [header.first_token], len(prompt), state
        self._headers[rid] = header
        return req

    def adopt(self, req: Req) -> None:
        header = self._headers.pop(req.rid)
        algo, cfg = self.binding.algorithm, self.binding.config
        di = algo.build_disagg_draft_input(self.pd_d.prebuilt(req), cfg, torch.tensor([header.first_token]), None)
        self.pd_d.adopt(req, di, header).result()

    def run(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> Outcome:
        """Hand off and adopt every prompt (with one SamplingParams, or one per prompt), then
        decode until the decode engine is idle."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        res = Outcome()
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            req = self.hand_off(prompt, f"r{i}", p)
            res.tokens[req.rid], res.accepted[req.rid] = [], []
            self.adopt(req)
        while not self.decode.idle:
            for d in self.decode.step():
                if d.rid not in res.tokens:  # an earlier request's last word (e.g. a failed one)
                    continue
                res.tokens[d.rid].extend(d.token_ids)
                if d.accepted_drafts is not None:
                    res.accepted[d.rid].append(d.accepted_drafts)
        return res

    def check_returned(self) -> None:
        for eng, side in ((self.prefill, "prefill"), (self.decode, "decode")):
            _assert_returned(eng, f"PD ({side})")
        for rows, side in ((self.rows_p, "prefill"), (self.rows_d, "decode")):
            rows.check()
            _expect(rows.num_used == 0, "PD", f"{rows.num_used} handoff rows still in use on the {side}")


def _attach_grammar(pd: DisaggEngine, req: Req) -> None:
    """What a node's Generate does before submitting (engine/service/grammar.py), synchronously."""
    if req.params.constraint is not None:
        req.grammar = new_matcher(pd.compile_grammar(req.params.constraint))


def check_algorithm(
    spec: SpecConfig,
    target_dir: str | Path,
    *,
    prompts: Sequence[list[int]] | None = None,
    max_new_tokens: int = 24,
    device: str = "cpu",
    page_size: int = 4,
    **engine_options: Any,
) -> ConformanceReport:
    """Run every conformance check of `spec`'s algorithm on the model at `target_dir`."""
    binding = bind(spec)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    base = dict(page_size=page_size, device=device, **engine_options)

    def engine(algorithm: AlgorithmBinding | None = None, **kw: Any) -> Engine:
        return Engine(EngineConfig(str(target_dir), **{**base, **kw}), algorithm=algorithm)

    plain_engine = engine()
    prompts = list(prompts or default_prompts(plain_engine.model_config.vocab_size))
    want = _run(plain_engine, prompts, greedy)
    report = ConformanceReport(binding.name)
    colocated: Outcome | None = None
    for name, kw in (
        ("colocated, overlap off", {}),
        ("colocated, overlap on", {"overlap": True}),
        (
            "CUDA graphs" if device.startswith("cuda") else "CUDA graphs (padded eager)",
            {"cuda_graph_max_bs": 4, "cuda_graph_padded_eager": True, "overlap": True},
        ),
    ):
        eng = engine(binding, future_map_debug=True, **kw)
        got = _run(eng, prompts, greedy)
        _expect(
            got.tokens == want.tokens, name, f"greedy output differs from plain decoding: {got.tokens} != {want.tokens}"
        )
        _assert_returned(eng, name)
        stats = eng.executor.spec_stats()
        report.mean_accept_len = stats.mean_accept_len if stats is not None else 1.0
        colocated = colocated or got
        report.checks.append(name)
    assert colocated is not None
    pd = InProcessPD(engine(binding), engine(binding, future_map_debug=True), binding)
    try:
        got = pd.run(prompts, greedy)
        _expect(got.tokens == want.tokens, "PD", f"output differs from colocated: {got.tokens} != {want.tokens}")
        # Trees re-rank candidates by score, and near-ties may order differently between a packed
        # and a separate prefill; chains have no ties to break, so their acceptance must match.
        if binding.config.eagle_topk == 1:
            _expect(
                got.accepted == colocated.accepted,
                "PD",
                f"acceptance differs from colocated: {got.accepted} != {colocated.accepted}",
            )
        pd.check_returned()
        report.checks.append("PD over the in-process transport")
        _check_bad_handoffs(pd, prompts[0], greedy)
        report.checks.append("empty batch and missing handoff state")
    finally:
        pd.close()
    _check_context_limit(engine, binding, plain_engine)
    report.checks.append("generation up to the context limit")
    return report


def _limit_prompts(limit: int, vocab: int) -> list[list[int]]:
    """Prompts ending 1 to 9 positions short of the limit: every window size gets cut."""
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(limit - 1 - short)] for short in (0, 1, 2, 3, 5, 8)]


def _check_context_limit(engine: Any, binding: AlgorithmBinding, plain_engine: Engine) -> None:
    """No max_tokens: every request runs until the context is full and ends with `length`;
    windows shrink near the end (no position past the model's table), greedy stays exact and
    sampled is the same in PD as colocated and with overlap on as off."""
    limit, vocab = plain_engine.max_context_len, plain_engine.model_config.vocab_size
    prompts = _limit_prompts(limit, vocab)
    greedy = SamplingParams(max_new_tokens=limit, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=limit, temperature=1.0, ignore_eos=True, seed=5)
    want = _run(plain_engine, prompts, greedy).tokens
    for params, name in ((greedy, "greedy"), (sampled, "sampled")):
        outcomes = {}
        for label, kw in (("overlap off", {}), ("overlap on", {"overlap": True})):
            eng = engine(binding, future_map_debug=True, **kw)
            outs = eng.generate(prompts, params)
            for o in outs:
                _expect(
                    o.finish_reason is not None
                    and o.finish_reason.value == "length"
                    and len(o.prompt_ids) + len(o.output_ids) == limit,
                    f"context limit ({name}, {label})",
                    f"{o.rid} ended with {o.finish_reason} after {len(o.output_ids)} tokens ({o.finish_detail})",
                )
            outcomes[label] = {f"r{i}": o.output_ids for i, o in enumerate(outs)}
            _assert_returned(eng, f"context limit ({name}, {label})")
        pd = InProcessPD(engine(binding), engine(binding, future_map_debug=True), binding)
        try:
            outcomes["PD"] = pd.run(prompts, params).tokens
            pd.check_returned()
        finally:
            pd.close()
        if params is greedy:
            _expect(outcomes["overlap off"] == want, "context limit (greedy)", "output differs from plain decoding")
        _expect(
            outcomes["PD"] == outcomes["overlap off"] == outcomes["overlap on"],
            f"context limit ({name})",
            f"PD / overlap on / overlap off differ: {outcomes}",
        )


def _check_bad_handoffs(pd: InProcessPD, prompt: list[int], params: SamplingParams) -> None:
    """An empty batch is a clear error; a request whose state is missing fails alone (when the
    algorithm carries state at all) and the decode engine goes on serving."""
    algo, cfg = pd.binding.algorithm, pd.binding.config
    from engine.core import Batch, ForwardMode

    try:
        algo.build_disagg_draft_input(Batch(ForwardMode.PREBUILT, []), cfg, torch.zeros(0, dtype=torch.int64), None)
    except ValueError as e:
        _expect("empty" in str(e).lower(), "empty batch", f"the error does not say the batch is empty: {e}")
    else:
        raise ConformanceError("empty batch: build_disagg_draft_input accepted a batch with no request")
    req = pd.hand_off(prompt, "missing-state", params)
    req.handoff = None
    if pd.pd_d.codec.payload_bytes:
        try:
            pd.adopt(req)
        except DisaggHandoffError as e:
            _expect(req.rid in e.rids, "missing state", f"the error does not name {req.rid}: {e.rids}")
        else:
            raise ConformanceError("missing state: a handoff without the algorithm's state was adopted")
        pd.pd_d.fail(req, "bad handoff").result()
    else:
        pd.adopt(req)  # nothing to miss: the first token is all it needs
    ok = pd.run([prompt], params)
    _expect(
        len(ok.tokens["r0"]) == params.max_new_tokens,
        "missing state",
        "the decode engine did not serve a normal request after a bad handoff",
    )
    while not pd.decode.idle:
        pd.decode.step()
    pd.check_returned()


__all__ = ["ConformanceError", "ConformanceReport", "InProcessPD", "check_algorithm", "default_prompts"]
