"""The EAGLE worker: an Executor that drafts, verifies with the target, and draft-extends.

Prefill (EXTEND): the target runs the prompt chunk; the head runs over the same positions
with tokens shifted left by one (the last one is the next prompt token, or the sampled bonus
when the chunk ends the prompt), writing draft KV at the target's slots. A finished prompt
publishes its length and stashes its bonus token, top-k and draft hidden state in the FutureMap
row of its slot: exactly what a PD decode node seeds from the handoff.

Decode: resolve lengths and draft input from the batch's FutureMap rows -> draft a tree ->
TARGET_VERIFY over W rows -> accept (spec.rejection) -> `on_publish` the new lengths -> move the
accepted rows' target KV to the front of the window (trees only) -> draft-extend over a
constant-width window (accepted rows first) -> stash the head's state at the last accepted row.
`seq_len` grows by accept_len = correct drafts + 1; the new bonus token has no KV. Between
iterations nothing but the slot index ties a request to its state, so the overlap scheduler can
launch the next decode before the host has seen this one's results.

Widths come from the algorithm: W = get_num_tokens_per_req_for_target_verify(ntok, False) rows
per verify (a chain drafts W - 1 tokens; a tree keeps the W - 1 best candidates) and the
draft-extend window is get_num_tokens_per_req_for_target_verify(ntok, True) rows, run in
TARGET_VERIFY shape when the algorithm `supports_target_verify_for_draft()`, else DRAFT_EXTEND.
The step count of each decode batch (and so its widths and graphs) is chosen when the batch is
formed (spec/eagle_steps.py): by batch size under adaptive steps, and never past the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core import Batch, ForwardMode, Req, StepOutput
from engine.algorithm import EngineParts
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
    seed_prebuilt_rows,
)
from engine.future_map import BatchRelay, DraftInput, FutureMap, RelayPayload
from engine.h2d import to_device
from engine.handoff import HandoffCodec
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.spec_stats import SpecStats
from spec.verify_step import accepted_rows, emit_device, host_output, verify_window
from spec.config import SpecConfig
from spec.draft_catch_up import DraftBacklog
from spec.draft_input import EagleDraftInput, EagleReqState, EagleVerifyInput
from spec.eagle_draft import DraftPicker, HeadPicker, build_draft_tree
from spec.eagle_handoff import EagleHandoffCodec
from spec.eagle_iteration import EagleIterationGraphs
from spec.eagle_steps import StepState, StepStates
from spec.rejection import VerifyResult
from spec.windows import emitted_window, last_accepted_rows, shifted_tokens

if TYPE_CHECKING:
    from spec.registry import SpeculativeAlgorithm


@dataclass
class EaglePending:
    batch: Batch
    copy: HostCopy | None  # None: no request sampled (non-final prefill chunks only)
    state: StepState | None = None  # decode: the step count it ran with
    shadow: HostCopy | None = None  # 0 steps: the draft's catch-up scored its would-be drafts


class EagleWorker:
    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner,
        sampler: Sampler,
        config: SpecConfig,
        aux_layers: tuple[int, ...],
        states: StepStates,
    ) -> None:
        self.target, self.draft, self.sampler = target, draft, sampler
        self.cfg = config
        self.aux_layers = aux_layers  # EAGLE-3: target layers whose inputs feed the head
        self.states = states
        self.stats = SpecStats(max_drafts=states.active.widths.drafts)
        self.picker: DraftPicker = HeadPicker()
        self.iteration: EagleIterationGraphs | None = None  # whole-iteration graphs (capture_cuda_graphs)
        self._future_map: FutureMap | None = None
        # A 0-step iteration stashes no top-k: only a drafting iteration reads it, and the head's
        # lm_head + top-k over the vocabulary is most of the draft's cost there. The first drafting
        # iteration after it computes it from the stashed hidden state (`_settle_guesses`). Set
        # before the graphs are captured: the 0-step graphs are built with or without the guess.
        self.defer_guess = True
        self._guessless: set[str] = set()  # requests whose row holds no top-k
        self.guesses_recomputed = 0  # rows given their top-k late (after 0-step iterations)
        # 0-step iteration graphs skip the head entirely and leave it a backlog, drained in bulk
        # (spec/draft_catch_up.py). Needs the deferred guess and the iteration graphs.
        self.batch_catch_up = True
        self.backlog: DraftBacklog | None = None

    @classmethod
    def create(
        cls, parts: EngineParts, config: SpecConfig, fmt: str, algorithm: "SpeculativeAlgorithm"
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
        maybe_enable_cuda_graphs(draft, parts.config.cuda_graph_max_bs, parts.config.cuda_graph_padded_eager)
        return cls(parts.runner, draft, parts.sampler, config, aux, states)

    # ---- Executor protocol ----
    def bind_future_map(self, future_map: FutureMap) -> None:
        self._future_map = future_map

    @property
    def future_map(self) -> FutureMap:
        if self._future_map is None:
            raise RuntimeError("no FutureMap bound: the scheduler binds one at start-up")
        return self._future_map

    def kv_tokens_per_decode(self) -> int:
        return self.states.max_window

    def decode_window(self, batch_size: int, room: int) -> int:
        return self.states.choose(batch_size, room).window

    def supports_overlap(self) -> bool:
        return True

    @staticmethod
    def _draft_steps(state: StepState) -> int:
        """Drafting depth: a chain fills the verify window; a tree drafts its levels."""
        return state.widths.drafts if state.is_chain else state.steps

    def capture_cuda_graphs(self) -> None:
        """Verify, draft-step and draft-extend graphs of every step count's state, for the batch
        sizes that state can run at (adaptive pruning), at start-up; then no more captures.
        Shapes follow the drafting: step s of a tree sees a mask over s * topk scratch slots."""
        graphs = self.target.graphs
        self.states.set_graph_batch_sizes(list(graphs.batch_sizes) if graphs is not None else None)
        dev, dtype = self.target.device, self.draft.pool.buffer.dtype
        target_h = self.target.model.config.hidden_size
        feat_width = target_h * len(self.aux_layers) if self.aux_layers else target_h
        feats = torch.empty(0, feat_width, dtype=dtype, device=dev)
        draft_feats = torch.empty(0, self.draft.model.config.hidden_size, dtype=dtype, device=dev)
        for state in self.states.states.values():
            sizes = list(state.graph_batch_sizes) if state.graph_batch_sizes is not None else None
            if sizes == []:
                continue
            k, w, tree = state.topk, state.widths, not state.is_chain
            self.target.capture(
                ForwardMode.TARGET_VERIFY,
                w.verify,
                sizes,
                tree_width=w.verify if tree else None,
                aux_hidden_layers=self.aux_layers,
            )
            self.draft.capture(w.draft_mode, w.draft, sizes, features=feats)
            for step in range(1, self._draft_steps(state)):
                self.draft.capture(
                    ForwardMode.DECODE,
                    1 if state.is_chain else k,
                    sizes,
                    tree_width=step * k if tree else None,
                    features=draft_feats,
                )
        self.target.freeze_graphs()
        self.draft.freeze_graphs()
        if graphs is not None and self.cfg.eagle_topk == 1:  # chains: one graph per iteration
            self.iteration = EagleIterationGraphs(self, list(graphs.batch_sizes), capture=graphs.use_graphs)
            self.future_map.reserve_extras(topk=1, hidden_size=self.draft.model.config.hidden_size, hidden_dtype=dtype)
            if self.batch_catch_up and self.defer_guess and 0 in self.states.states:
                self.backlog = DraftBacklog(
                    self,
                    self.states.states[0].widths.draft_mode,
                    feat_width,
                    dtype,
                    list(graphs.batch_sizes),
                    capture=graphs.use_graphs,
                )
            self.iteration.prepare(
                list(self.states.states.values()), self.future_map, self.draft.model.config.hidden_size, dtype
            )

    def on_admit(self, req: Req) -> None:
        self.sampler.on_admit(req)
        self.picker.on_admit(req)

    def adopt_prebuilt(self, reqs: list[Req], draft_input: DraftInput, relay: BatchRelay) -> None:
        seed_prebuilt_rows(reqs, draft_input, relay)
        self._fresh_draft_state(reqs)

    def on_release(self, req: Req) -> None:
        req.spec_state = None
        self._fresh_draft_state([req])

    def _fresh_draft_state(self, reqs: list[Req]) -> None:
        """The request's FutureMap row holds a complete draft state (or it left)."""
        for req in reqs:
            self._guessless.discard(req.rid)
            if self.backlog is not None:
                self.backlog.forget(req.rid)

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

    @torch.inference_mode()
    def step(self, batch: Batch, relay: BatchRelay) -> StepOutput:
        return self.collect(self.launch(batch, relay))

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
            self.states.shadow_feedback(
                len(batch.reqs), [h / n for h, n in zip(scored["hits"].tolist(), scored["samples"].tolist()) if n > 0]
            )
        self.states.feedback(len(batch.reqs), out.accepted_drafts or [])
        return out

    # ---- prefill ----
    def features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """What the head reads from the target: its last hidden state, or (EAGLE-3) the
        concatenated low/mid/high layer outputs."""
        return torch.cat(aux, dim=-1) if self.aux_layers else hidden

    def _prefill(self, batch: Batch, relay: BatchRelay) -> EaglePending:
        reqs, lens, prefix = batch.reqs, batch.extend_lens, batch.prefix_lens
        dev = self.target.device
        slots = [r.slot for r in reqs]
        ctx = self.target.make_context(ForwardMode.EXTEND, slots, prefix, lens, aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.forward(build_input_ids(batch, dev), ctx)
        feats = self.features(hidden, aux)
        sampling = sampling_reqs(batch)
        rows = last_token_rows(batch, dev)
        shifted = to_device(shifted_tokens(batch), dev)  # draft-extend input: shifted left by one
        out, done = None, relay.select(batch.sample)
        if sampling:
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
        p, topk_idx = self.picker.guess(
            self.draft.model, g_last, self.cfg.eagle_topk, done.indices, to_device(ends, dev) + 1
        )
        done.stash(RelayPayload(out["tokens"], p, topk_idx, g_last))
        self._fresh_draft_state(sampling)
        _keep_handoff(sampling, p, topk_idx, g_last)
        return EaglePending(batch, HostCopy(out))

    # ---- decode ----
    def _decode(self, batch: Batch, relay: BatchRelay) -> EaglePending:
        reqs, state = batch.reqs, self.states.active  # chosen when the batch was formed
        rids = [r.rid for r in reqs]
        leaves_backlog, scored = self._catch_up(reqs, rids, relay, state)
        shadow = HostCopy(scored) if scored is not None and state.steps == 0 else None
        self._settle_guesses(rids, relay, state)
        if self.iteration is not None:
            out = self.iteration.run(reqs, relay.indices, state)
            if out is not None:
                if leaves_backlog:
                    assert self.backlog is not None
                    self.backlog.note_pushed(rids)
                    del out["accept_lens"]  # one token each: the host knows (host_output)
                return EaglePending(batch, HostCopy(out), state, shadow)
        bs, w = len(reqs), state.widths.verify
        slots, bound = [r.slot for r in reqs], batch.prefix_lens
        seq = relay.resolve_seq_lens()  # exact lengths, on the device only
        r = relay.resolve()
        di = EagleDraftInput(r.topk_p, r.topk_index, r.hidden_states, r.bonus_tokens, future_indices=relay.indices)
        tree = build_draft_tree(
            self.draft,
            di,
            slots,
            seq,
            bound,
            self._draft_steps(state),
            1 if state.is_chain else state.topk,
            w,
            self.picker,
        )
        vi = EagleVerifyInput.from_tree(tree, seq)
        ctx = self.target.make_context(
            ForwardMode.TARGET_VERIFY,
            slots,
            bound,
            [w] * bs,
            device_prefix=seq,
            positions=vi.positions,
            tree_mask=vi.tree_mask,
            aux_hidden_layers=self.aux_layers,
        )
        hidden, aux = self.target.forward(tree.tokens.reshape(-1), ctx)
        logits = self.target.logits(hidden)
        vr = verify_window(self.sampler, reqs, tree, logits, seq)
        relay.on_publish(seq + vr.accept_lens)  # between verify and draft-extend
        rows = accepted_rows(vr, w)  # (bs, W) window rows, accepted first
        if not tree.is_chain:
            self._compact_target_kv(slots, seq, rows, vr.accept_lens)
        self._draft_extend(state, slots, seq, bound, vr, self.features(hidden, aux), relay)
        return EaglePending(batch, HostCopy(emit_device(self.sampler, reqs, vr, logits, rows)), state, shadow)

    def defers_guess(self, state: StepState) -> bool:
        return self.defer_guess and state.steps == 0

    def pushes_backlog(self, state: StepState) -> bool:
        """Iteration graphs of this state skip the head and leave it a backlog. (Set the flags
        before capture; CPU tests flip them after, as padded-eager bodies read them every run.)"""
        return self.backlog is not None and self.batch_catch_up and self.defer_guess and state.steps == 0

    def _catch_up(
        self, reqs: list[Req], rids: list[str], relay: BatchRelay, state: StepState
    ) -> tuple[bool, dict[str, torch.Tensor] | None]:
        """Drain the draft's backlog where this iteration needs it: before it drafts or runs
        eagerly, or when a ring is full. Returns (whether the iteration adds to the backlog,
        the catch-up's first-draft scores if one ran)."""
        if self.backlog is None:
            return False, None
        pushes = self.pushes_backlog(state) and self.iteration is not None and self.iteration.runs(reqs, state)
        scored = None
        if not pushes or self.backlog.full(rids):
            scored = self.backlog.catch_up(rids, relay.indices)
        return pushes, scored

    def _settle_guesses(self, rids: list[str], relay: BatchRelay, state: StepState) -> None:
        """Before a drafting iteration, the rows a 0-step iteration left without a top-k get it
        from their stashed hidden state: the same top-k that iteration would have stashed (same
        hidden state, same positions), so acceptance is unchanged."""
        if self.defers_guess(state):
            self._guessless.update(rids)
            return
        stale = [rid in self._guessless for rid in rids]
        if not any(stale):
            return
        rows = relay.select(stale)
        seq, r = rows.peek()
        p, topk_idx = self.picker.guess(self.draft.model, r.hidden_states, self.cfg.eagle_topk, rows.indices, seq + 1)
        rows.stash(RelayPayload(r.bonus_tokens, p, topk_idx, r.hidden_states))
        self._guessless.difference_update(rids)
        self.guesses_recomputed += len(rows)

    def _compact_target_kv(
        self, slots: list[int], seq: torch.Tensor, rows: torch.Tensor, accept_lens: torch.Tensor
    ) -> None:
        """Tree verify wrote KV in tree order; move the accepted path's KV to [L, L + accept_len)."""
        table = self.target.kv.req_to_token
        slot_t = to_device(slots, seq.device).unsqueeze(1)
        j = torch.arange(rows.shape[1], device=seq.device).unsqueeze(0)
        # rows that stay in place copy onto themselves: a fixed-shape gather/scatter (no mask
        # indexing, so no host sync); the clone covers sources and targets that overlap
        src = table[slot_t, seq.unsqueeze(1) + rows].reshape(-1)
        dst = table[slot_t, seq.unsqueeze(1) + torch.where(j < accept_lens.unsqueeze(1), j, rows)]
        pool = self.target.pool
        flat = pool.buffer.view(pool.num_layers, 2, -1, pool.num_kv_heads, pool.head_dim)
        flat[:, :, dst.reshape(-1)] = flat[:, :, src].clone()

    def _draft_extend(
        self,
        state: StepState,
        slots: list[int],
        seq: torch.Tensor,
        bound: list[int],
        vr: VerifyResult,
        feats: torch.Tensor,
        relay: BatchRelay,
    ) -> None:
        """Head over [L, L + Wd): row j pairs the target's feature at accepted row j with the
        token that followed it; rows past the accepted length only scribble beyond seq_len."""
        bs, w, wd = len(slots), state.widths.verify, state.widths.draft
        rows = accepted_rows(vr, wd)
        flat_rows = (rows + torch.arange(bs, device=rows.device).unsqueeze(1) * w).reshape(-1)
        ctx = self.draft.make_context(state.widths.draft_mode, slots, bound, [wd] * bs, device_prefix=seq)
        g = self.draft.forward(emitted_window(vr, wd).reshape(-1), ctx, features=feats[flat_rows])
        g_last = g[last_accepted_rows(vr, wd)]
        if self.defers_guess(state):
            relay.stash(RelayPayload(vr.bonus, None, None, g_last), keep_topk=True)
            return
        p, topk_idx = self.picker.guess(
            self.draft.model, g_last, self.cfg.eagle_topk, relay.indices, seq + vr.accept_lens + 1
        )
        relay.stash(RelayPayload(vr.bonus, p, topk_idx, g_last))


def _keep_handoff(reqs: list[Req], p: torch.Tensor, idx: torch.Tensor, g: torch.Tensor) -> None:
    """PD prefill: a request that leaves this node (hold_kv) carries its draft state in the
    handoff row (EagleHandoffCodec encodes it); everyone else keeps only its FutureMap row."""
    for i, req in enumerate(reqs):
        if req.hold_kv:
            req.spec_state = EagleReqState(p[i], idx[i], g[i])


__all__ = ["EaglePending", "EagleWorker"]
