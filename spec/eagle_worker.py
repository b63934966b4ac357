"""The EAGLE worker: an Executor that drafts, verifies with the target, and draft-extends.

Prefill (EXTEND): the target runs the prompt chunk; the head runs over the same positions
with tokens shifted left by one (the last one is the next prompt token, or the sampled bonus
when the chunk ends the prompt), writing draft KV at the target's slots. A finished prompt
publishes its length and stashes its bonus token, top-k and draft hidden state in the FutureMap
row of its slot: exactly what a PD decode node seeds from the handoff.

Decode: one iteration (spec/eagle_iteration.py, run eagerly or replayed as one graph) per batch,
with the step count the batch was planned with (`Batch.plan`, chosen at the top of the decode
iteration by `activate_step_by_batch`). Between iterations nothing but the slot index ties a
request to its state, so the overlap scheduler can launch the next decode before the host has
seen this one's results.

Widths come from the algorithm: W = get_num_tokens_per_req_for_target_verify(ntok, False) rows
per verify (a chain drafts W - 1 tokens; a tree keeps the W - 1 best candidates) and the
draft-extend window is get_num_tokens_per_req_for_target_verify(ntok, True) rows, run in
TARGET_VERIFY shape when the algorithm `supports_target_verify_for_draft()`, else DRAFT_EXTEND.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.algorithm import EngineParts
from engine.core import Batch, DecodePlan, ForwardMode, Req, StepOutput
from engine.executor import (
    HostCopy,
    build_input_ids,
    last_token_rows,
    maybe_enable_cuda_graphs,
    sample_positions,
    sample_tokens,
    sampled_output,
    sampling_reqs,
    scatter_to_batch,
)
from engine.future_map import BatchRelay, DraftInput, FutureMap, RelayPayload
from engine.h2d import to_device
from engine.handoff import HandoffCodec
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.spec_stats import SpecStats
from engine.worker import WorkerBase
from spec.config import SpecConfig
from spec.constrained_graphs import ConstrainedIterationGraphs
from spec.draft_catch_up import DraftBacklog
from spec.draft_input import EagleReqState
from spec.eagle_draft import DraftPicker, EagleModels, HeadPicker
from spec.eagle_handoff import EagleHandoffCodec
from spec.eagle_iteration import EagleIteration, EagleIterationGraphs, eager_flow
from spec.eagle_steps import StepState, StepStates, WidthHooks
from spec.verify_step import host_output
from spec.windows import shifted_tokens


@dataclass
class EaglePending:
    batch: Batch
    copy: HostCopy | None  # None: no request sampled (non-final prefill chunks only)
    state: StepState | None = None  # decode: the step count it ran with
    shadow: HostCopy | None = None  # 0 steps: the draft's catch-up scored its would-be drafts


class EagleWorker(WorkerBase):
    def __init__(self, models: EagleModels, sampler: Sampler, config: SpecConfig, states: StepStates) -> None:
        super().__init__(models.target, sampler)
        self.models, self.cfg, self.states = models, config, states
        self.stats = SpecStats(max_drafts=states.initial.widths.drafts)
        self.iteration: EagleIteration | None = None  # with the FutureMap (bind_future_map)
        self.iteration_graphs: EagleIterationGraphs | None = None  # whole-iteration graphs (capture_cuda_graphs)
        self.constrained_graphs: ConstrainedIterationGraphs | None = None  # the same, split around grammar masks
        self._guessless: set[str] = set()  # requests whose row holds no top-k (a deferred guess)
        self.guesses_recomputed = 0  # rows given their top-k late (after 0-step iterations)

    @classmethod
    def create(
        cls,
        parts: EngineParts,
        config: SpecConfig,
        fmt: str,
        algorithm: WidthHooks,
        picker: DraftPicker | None = None,
    ) -> "EagleWorker":
        from engine.draft_loader import load_draft_model

        assert config.draft_model_path is not None
        states = StepStates(algorithm, config)  # widths checked before the (slow) head load
        head, hcfg, aux = load_draft_model(
            config.draft_model_path, fmt, parts.runner.model, parts.model_config, parts.dtype, parts.device
        )
        pool = KVPool(
            hcfg.num_layers,
            parts.kv.allocator.num_pages,
            parts.kv.page_size,
            hcfg.num_kv_heads,
            hcfg.head_dim,
            parts.dtype,
            parts.device,
        )
        why = (
            True
            if algorithm.supports_target_verify_for_draft()
            else (f"{algorithm.name}.supports_target_verify_for_draft() is False")
        )
        draft = ModelRunner(head, parts.kv, pool, parts.runner.attn_backend, parts.device, target_verify=why)
        maybe_enable_cuda_graphs(
            draft,
            parts.config.cuda_graph_max_bs,
            parts.config.cuda_graph_padded_eager,
            parts.config.cuda_graph_prompt_tokens,
        )
        models = EagleModels(parts.runner, draft, picker or HeadPicker(), aux)
        return cls(models, parts.sampler, config, states)

    # ---- the runners, as the models hold them ----
    @property
    def target(self) -> ModelRunner:
        return self.models.target

    @property
    def draft(self) -> ModelRunner:
        return self.models.draft

    @property
    def picker(self) -> DraftPicker:
        return self.models.picker

    @property
    def backlog(self) -> DraftBacklog | None:
        return self.iteration.backlog if self.iteration is not None else None

    # ---- Executor hooks ----
    def bind_future_map(self, future_map: FutureMap) -> None:
        super().bind_future_map(future_map)
        self.iteration = EagleIteration(
            self.models,
            future_map,
            self.cfg.eagle_topk,
            defer_guess=self.cfg.defer_guess,
            batch_catch_up=self.cfg.batch_catch_up,
        )

    def kv_tokens_per_decode(self) -> int:
        return self.states.max_window

    def activate_step_by_batch(self, batch_size: int) -> int:
        return self.states.activate_step_by_batch(batch_size)

    def plan_decode(self, batch_size: int, room: int) -> DecodePlan:
        return self.states.fit(self.activate_step_by_batch(batch_size), room).plan()

    def capture_cuda_graphs(self) -> None:
        """Verify, draft-step and draft-extend graphs of every step count's state, for the batch
        sizes that state can run at (adaptive pruning), at start-up; then no more captures.
        Shapes follow the drafting: step s of a tree sees a mask over s * topk scratch slots."""
        target, draft, graphs = self.target, self.draft, self.target.graphs
        self.states.set_graph_batch_sizes(list(graphs.batch_sizes) if graphs is not None else None)
        dev, dtype = target.device, draft.pool.buffer.dtype
        aux = self.models.aux_layers
        feat_width = target.model.config.hidden_size * max(len(aux), 1)
        feats = torch.empty(0, feat_width, dtype=dtype, device=dev)
        draft_feats = torch.empty(0, draft.model.config.hidden_size, dtype=dtype, device=dev)
        for state in self.states.states.values():
            sizes = list(state.graph_batch_sizes) if state.graph_batch_sizes is not None else None
            if sizes == []:
                continue
            k, w, tree = state.topk, state.widths, not state.is_chain
            target.capture(
                ForwardMode.TARGET_VERIFY, w.verify, sizes, tree_width=w.verify if tree else None, aux_hidden_layers=aux
            )
            draft.capture(w.draft_mode, w.draft, sizes, features=feats)
            for step in range(1, state.draft_steps):
                draft.capture(
                    ForwardMode.DECODE,
                    1 if state.is_chain else k,
                    sizes,
                    tree_width=step * k if tree else None,
                    features=draft_feats,
                )
        target.capture_prompts(ForwardMode.EXTEND, aux_hidden_layers=aux)
        draft.capture_prompts(ForwardMode.DRAFT_EXTEND, features=feats)
        target.freeze_graphs()
        draft.freeze_graphs()
        if graphs is not None and self.cfg.eagle_topk == 1:  # chains: one graph per iteration
            self._capture_iterations(list(graphs.batch_sizes), graphs.use_graphs, feat_width, dtype)

    def _capture_iterations(self, sizes: list[int], capture: bool, feat_width: int, dtype: torch.dtype) -> None:
        it, fm = self.iteration, self.future_map
        assert it is not None
        hidden = self.draft.model.config.hidden_size
        fm.reserve_extras(topk=1, hidden_size=hidden, hidden_dtype=dtype)
        if it.defer_guess and 0 in self.states.states:  # 0-step graphs may leave the head a backlog
            mode = self.states.states[0].widths.draft_mode
            it.backlog = DraftBacklog(self.models, fm, mode, feat_width, dtype, sizes, capture=capture)
        self.iteration_graphs = EagleIterationGraphs(it, sizes, capture=capture)
        self.iteration_graphs.prepare(list(self.states.states.values()), hidden, dtype)
        self.constrained_graphs = ConstrainedIterationGraphs(it, sizes, capture, self.sampler.vocab_size)
        self.constrained_graphs.prepare(list(self.states.states.values()))

    def on_admit(self, req: Req) -> None:
        self.sampler.on_admit(req)
        self.picker.on_admit(req)

    def adopt_prebuilt(self, reqs: list[Req], draft_input: DraftInput, relay: BatchRelay) -> None:
        super().adopt_prebuilt(reqs, draft_input, relay)
        self._fresh_draft_state(reqs)

    def on_release(self, req: Req) -> None:
        super().on_release(req)
        self._fresh_draft_state([req])

    def prefix_cache_shift(self) -> int:
        return 1  # the head's KV at position i is computed from token i + 1

    def cacheable_tokens(self, req: Req) -> int:
        """The draft's KV lags the target's by the request's backlog (0-step iterations)."""
        backlog = self.backlog
        return req.seq_len - (backlog.pending_of(req.rid) if backlog is not None else 0)

    def _fresh_draft_state(self, reqs: list[Req]) -> None:
        """The request's FutureMap row holds a complete draft state (or it left)."""
        backlog = self.backlog
        for req in reqs:
            self._guessless.discard(req.rid)
            if backlog is not None:
                backlog.forget(req.rid)

    def extra_kv_pools(self) -> list[KVPool]:
        """PD: the draft KV moves with the target's, by the same page ids."""
        return [self.draft.pool]

    def handoff_codec(self) -> HandoffCodec:
        """PD: the draft's top-k and hidden state travel in the handoff row."""
        return EagleHandoffCodec(self.cfg.eagle_topk, self.draft.model.config.hidden_size, self.draft.pool.buffer.dtype)

    def spec_stats(self) -> SpecStats:
        return self.stats

    def adaptive_snapshot(self) -> dict[str, Any] | None:
        return self.states.snapshot()

    def settles_grammar_in_launch(self) -> bool:
        return True  # every matcher read (first tokens, forced drafts, window masks) follows a settle

    @torch.inference_mode()
    def launch(self, batch: Batch, relay: BatchRelay) -> EaglePending:
        if batch.mode is ForwardMode.EXTEND:
            return self._prefill(batch, relay)
        return self._decode(batch, relay)

    def collect(self, pending: EaglePending) -> StepOutput:
        batch = pending.batch
        if pending.copy is None:
            return StepOutput(tokens=[[] for _ in batch.reqs])
        if batch.mode is ForwardMode.EXTEND:
            return scatter_to_batch(sampled_output(pending.copy.wait()), batch.sample)
        assert pending.state is not None
        out = host_output(self.stats, pending.copy.wait(), pending.state.widths.drafts)
        if pending.shadow is not None:
            scored = pending.shadow.wait()
            hits = zip(scored["hits"].tolist(), scored["samples"].tolist())
            self.states.shadow_feedback(len(batch.reqs), [h / n for h, n in hits if n > 0])
        self.states.feedback(len(batch.reqs), out.accepted_drafts or [])
        return out

    # ---- prefill ----
    def _prefill(self, batch: Batch, relay: BatchRelay) -> EaglePending:
        m, reqs, lens, prefix = self.models, batch.reqs, batch.extend_lens, batch.prefix_lens
        dev = self.target.device
        slots = [r.slot for r in reqs]
        ctx = self.target.make_context(ForwardMode.EXTEND, slots, prefix, lens, aux_hidden_layers=m.aux_layers)
        hidden, aux = self.target.forward(build_input_ids(batch, dev), ctx)
        feats = m.features(hidden, aux)
        sampling = sampling_reqs(batch)
        rows = last_token_rows(batch, dev)
        shifted = to_device(shifted_tokens(batch), dev)  # draft-extend input: shifted left by one
        out, done = None, relay.select(batch.sample)
        if sampling:
            if any(r.grammar is not None for r in sampling):
                batch.settle_grammar()  # the prompt's forward is enqueued
            out = sample_tokens(self.sampler, self.target.logits(hidden[rows]), sampling, sample_positions(batch))
            shifted[rows] = out["tokens"]  # the tail of a finished prompt is its sampled bonus
            ends = [p + n for p, n, s in zip(prefix, lens, batch.sample) if s]
            # fence before draft-extend: the next decode's lengths do not wait for the head
            done.on_publish(to_device(ends, dev))
        dctx = self.draft.make_context(ForwardMode.DRAFT_EXTEND, slots, prefix, lens)
        g = self.draft.forward(shifted, dctx, features=feats)
        if out is None:
            return EaglePending(batch, None)
        g_last = g[rows]
        p, topk_idx = self.picker.guess(m.head, g_last, self.cfg.eagle_topk, done.indices, to_device(ends, dev) + 1)
        done.stash(RelayPayload(out["tokens"], p, topk_idx, g_last))
        self._fresh_draft_state(sampling)
        _keep_handoff(sampling, p, topk_idx, g_last)
        return EaglePending(batch, HostCopy(out))

    # ---- decode ----
    def _decode(self, batch: Batch, relay: BatchRelay) -> EaglePending:
        reqs, state, it = batch.reqs, batch.plan.state, self.iteration  # the state it was planned with
        assert isinstance(state, StepState) and it is not None
        rids = [r.rid for r in reqs]
        leaves_backlog, scored = self._catch_up(reqs, rids, relay, state)
        shadow = HostCopy(scored) if scored is not None and state.steps == 0 else None
        self._settle_guesses(rids, relay, state)
        if self.iteration_graphs is not None:
            out = self.iteration_graphs.run(reqs, relay.indices, state)
            if out is not None:
                if leaves_backlog:
                    assert it.backlog is not None
                    it.backlog.note_pushed(rids)
                    del out["accept_lens"]  # one token each: the host knows (host_output)
                return EaglePending(batch, HostCopy(out), state, shadow)
        if self.constrained_graphs is not None:
            out = self.constrained_graphs.run(reqs, relay.indices, state, batch.settle_grammar)
            if out is not None:
                return EaglePending(batch, HostCopy(out), state, shadow)
        out = it.run(relay.indices, state, eager_flow(self.sampler, reqs, batch.settle_grammar))
        return EaglePending(batch, HostCopy(out), state, shadow)

    def _catch_up(
        self, reqs: list[Req], rids: list[str], relay: BatchRelay, state: StepState
    ) -> tuple[bool, dict[str, torch.Tensor] | None]:
        """Drain the draft's backlog where this iteration needs it: before it drafts or runs
        eagerly, or when a ring is full. Returns (whether the iteration adds to the backlog,
        the catch-up's first-draft scores if one ran)."""
        it = self.iteration
        if it is None or it.backlog is None:
            return False, None
        pushes = (
            it.pushes_backlog(state) and self.iteration_graphs is not None and self.iteration_graphs.runs(reqs, state)
        )
        scored = None
        if not pushes or it.backlog.full(rids):
            scored = it.backlog.catch_up(rids, relay.indices)
        return pushes, scored

    def _settle_guesses(self, rids: list[str], relay: BatchRelay, state: StepState) -> None:
        """Before a drafting iteration, the rows a 0-step iteration left without a top-k get it
        from their stashed hidden state: the same top-k that iteration would have stashed (same
        hidden state, same positions), so acceptance is unchanged."""
        assert self.iteration is not None
        if self.iteration.defers_guess(state):
            self._guessless.update(rids)
            return
        stale = [rid in self._guessless for rid in rids]
        if not any(stale):
            return
        rows = relay.select(stale)
        seq, r = rows.peek()
        p, topk_idx = self.picker.guess(self.models.head, r.hidden_states, self.cfg.eagle_topk, rows.indices, seq + 1)
        rows.stash(RelayPayload(r.bonus_tokens, p, topk_idx, r.hidden_states))
        self._guessless.difference_update(rids)
        self.guesses_recomputed += len(rows)


def _keep_handoff(reqs: list[Req], p: torch.Tensor, idx: torch.Tensor, g: torch.Tensor) -> None:
    """PD prefill: a request that leaves this node (hold_kv) carries its draft state in the
    handoff row (EagleHandoffCodec encodes it); everyone else keeps only its FutureMap row. The
    state starts for the host here, right behind the kernels that made it, so the encoder (on the
    node's event loop) waits for these copies alone: a copy made there waited for whatever the
    scheduler had queued since, 4-6 ms a handoff on two H200s with EAGLE (bench/RESULTS.md,
    prefix cache, thirteenth run)."""
    held = [i for i, req in enumerate(reqs) if req.hold_kv]
    if not held:
        return
    if len(held) < len(reqs):
        rows = to_device(held, p.device)
        p, idx, g = p[rows], idx[rows], g[rows]
    copy = HostCopy({"p": p, "idx": idx, "g": g})
    host = copy.unwaited()
    for j, i in enumerate(held):
        reqs[i].spec_state = EagleReqState(host["p"][j], host["idx"][j], host["g"][j], copied=copy)


__all__ = ["EaglePending", "EagleWorker"]
