"""One EAGLE decode iteration: the one implementation that eager runs and whole-iteration graphs call.

Resolve the batch's FutureMap rows -> draft (a chain, or a top-k tree) -> TARGET_VERIFY -> accept
-> publish the new lengths -> (trees) move the accepted path's target KV to the front of the
window -> draft-extend over a fixed-width window (accepted rows first) -> stash the head's state at
the last accepted row. `seq_len` grows by accept_len = correct drafts + 1; the new bonus token has
no KV. Every context is built on the device from the resolved lengths (ModelRunner.window_context),
so the same ops run for one batch eagerly and inside a graph captured per (padded batch size, step
count); a `Flow` says what differs between the two: how drafts are verified and what is emitted
(the sampler's exact acceptance and logprobs, or a greedy argmax), and whether the iteration is
being captured (then the replay's caller waits on and records the FutureMap's publish event,
forwards skip the per-forward graphs, and padded rows are kept at zero).

Graphs take chain states (topk 1, or zero drafts) of batches whose requests are all greedy
without penalties, min_tokens, logit_bias or logprobs, up to the largest captured batch size; the
rest run eagerly, with the same results. Padded rows read and write FutureMap row 0, kept at zero,
and KV page 0, reserved for padding. The captured body also runs uncaptured on the padded buffers
off CUDA, which is what makes "graphs equal eager" testable on a CPU. Between separately replayed
forward graphs the host would otherwise spend milliseconds on the small ops a whole-iteration
graph holds, which on a small target costs more than the GPU work itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from engine.core import ForwardMode, Req
from engine.forward_context import ForwardContext
from engine.future_map import FutureMap, RelayPayload
from engine.relay_step import commit_decode, resolve_decode
from engine.sampler import Sampler, plain_argmax_ok
from engine.step_graphs import StepGraph, StepGraphs
from spec.draft_catch_up import DraftBacklog
from spec.draft_input import EagleDraftInput, EagleVerifyInput
from spec.eagle_draft import EagleModels, build_draft_tree
from spec.eagle_steps import StepState
from spec.jump_forward import offer_forced_drafts
from spec.rejection import VerifyResult, verify_greedy
from spec.tree import DraftTree
from spec.verify_step import accepted_rows, emit_device, verify_window
from spec.windows import emitted_window, last_accepted_rows

Verifier = Callable[[DraftTree, torch.Tensor, torch.Tensor], VerifyResult]  # (tree, logits, seq)
Emitter = Callable[[VerifyResult, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]  # (vr, logits, rows)


@dataclass(frozen=True)
class Flow:
    """What differs between an iteration run for one batch and one captured whole; `offer`
    rewrites the drafted window before verification (the grammar's forced tokens as drafts)."""

    captured: bool
    verify: Verifier
    emit: Emitter
    offer: Callable[[DraftTree], DraftTree] | None = None


def _greedy_verify(tree: DraftTree, logits: torch.Tensor, seq: torch.Tensor) -> VerifyResult:
    return verify_greedy(tree, logits.argmax(-1).view(tree.tokens.shape))


def _accepted(vr: VerifyResult, logits: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accept_lens": vr.accept_lens, "emitted": vr.emitted}


GRAPH_FLOW = Flow(captured=True, verify=_greedy_verify, emit=_accepted)


def eager_flow(sampler: Sampler, reqs: list[Req], settle: Callable[[], None] = lambda: None) -> Flow:
    """A batch run as it is: exact acceptance under its sampling parameters (grammar masks at
    every window row included), penalties recorded, logprobs where asked; constrained requests
    draft what their grammar forces first, once `settle` brought the batch in flight's tokens into
    their matchers (the drafts are enqueued by then)."""
    offer = None
    if any(r.grammar is not None for r in reqs):

        def offer(tree: DraftTree) -> DraftTree:
            settle()
            return offer_forced_drafts(reqs, tree)

    return Flow(False, partial(verify_window, sampler, reqs), partial(emit_device, sampler, reqs), offer)


def _kept(real: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """`rows` with padded rows (slot 0) zeroed, so FutureMap row 0 stays zero; as is off a graph."""
    if real is None:
        return rows
    return torch.where(real.view(-1, *([1] * (rows.dim() - 1))), rows, 0)


class EagleIteration:
    """The decode iteration of one EAGLE worker over its FutureMap."""

    def __init__(
        self, models: EagleModels, future_map: FutureMap, topk: int, *, defer_guess: bool, batch_catch_up: bool
    ) -> None:
        self.models, self.future_map, self.topk = models, future_map, topk
        # A 0-step iteration stashes no top-k when deferring: only a drafting iteration reads it,
        # and the head's lm_head + top-k over the vocabulary is most of the draft's cost there.
        self.defer_guess, self.batch_catch_up = defer_guess, batch_catch_up
        self.backlog: DraftBacklog | None = None  # installed with the 0-step graphs

    def defers_guess(self, state: StepState) -> bool:
        return self.defer_guess and state.steps == 0

    def pushes_backlog(self, state: StepState) -> bool:
        """A captured iteration of this state skips the head and leaves it a backlog."""
        return self.backlog is not None and self.batch_catch_up and self.defers_guess(state)

    def run(self, slots: torch.Tensor, state: StepState, flow: Flow) -> dict[str, torch.Tensor]:
        """The iteration for the requests at `slots` (padded with 0 when captured); returns what
        the host reads: at least "accept_lens" and "emitted" (one token each without the first)."""
        if flow.captured and self.pushes_backlog(state):
            return self._target_only(slots)
        seq, tree = self.draft(slots, state, flow.captured)
        if flow.offer is not None:
            tree = flow.offer(tree)
        return self.verify_and_extend(slots, state, seq, tree, flow)

    def draft(self, slots: torch.Tensor, state: StepState, direct: bool) -> tuple[torch.Tensor, DraftTree]:
        """The first half: the rows' exact lengths (on the device only) and the drafted window."""
        m, fm = self.models, self.future_map
        seq = fm.resolve_seq_lens(slots, wait=not direct)
        r = fm.resolve(slots, wait=not direct)
        di = EagleDraftInput(r.topk_p, r.topk_index, r.hidden_states, r.bonus_tokens, future_indices=slots)
        w = state.widths.verify
        tree = build_draft_tree(m, di, slots, seq, state.draft_steps, 1 if state.is_chain else state.topk, w, direct)
        return seq, tree

    def verify_and_extend(
        self, slots: torch.Tensor, state: StepState, seq: torch.Tensor, tree: DraftTree, flow: Flow
    ) -> dict[str, torch.Tensor]:
        """The second half: verify the window, publish the new lengths, draft-extend, emit."""
        m, fm, direct, w = self.models, self.future_map, flow.captured, state.widths.verify
        hidden, aux = m.run_target(tree.tokens.reshape(-1), self._verify_context(tree, slots, seq, w), direct)
        logits = m.target.logits(hidden)
        vr = flow.verify(tree, logits, seq)
        real = slots != 0 if direct else None
        fm.publish(slots, _kept(real, seq + vr.accept_lens), record=not direct)  # before draft-extend
        rows = accepted_rows(vr, w)  # (bs, W) window rows, accepted first
        if not tree.is_chain:
            self._compact_target_kv(slots, seq, rows, vr.accept_lens)
        self._draft_extend(state, slots, seq, vr, m.features(hidden, aux), real, direct)
        return flow.emit(vr, logits, rows)

    def _verify_context(self, tree: DraftTree, slots: torch.Tensor, seq: torch.Tensor, w: int) -> ForwardContext:
        target = self.models.target
        if tree.is_chain:  # causal in row order at positions seq_len + row
            return target.window_context(
                ForwardMode.TARGET_VERIFY, slots, seq, w, aux_hidden_layers=self.models.aux_layers
            )
        vi = EagleVerifyInput.from_tree(tree, seq)
        return target.window_context(
            ForwardMode.TARGET_VERIFY,
            slots,
            seq,
            w,
            positions=vi.positions,
            tree_mask=vi.tree_mask,
            aux_hidden_layers=self.models.aux_layers,
        )

    def _compact_target_kv(
        self, slots: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor, accept_lens: torch.Tensor
    ) -> None:
        """Tree verify wrote KV in tree order; move the accepted path's KV to [L, L + accept_len)."""
        target = self.models.target
        table = target.kv.req_to_token
        j = torch.arange(rows.shape[1], device=seq.device).unsqueeze(0)
        # rows that stay in place copy onto themselves: a fixed-shape gather/scatter (no mask
        # indexing, so no host sync); the clone covers sources and targets that overlap
        src = table[slots.unsqueeze(1), seq.unsqueeze(1) + rows].reshape(-1)
        dst = table[slots.unsqueeze(1), seq.unsqueeze(1) + torch.where(j < accept_lens.unsqueeze(1), j, rows)]
        pool = target.pool
        flat = pool.buffer.view(pool.num_layers, 2, -1, pool.num_kv_heads, pool.head_dim)
        flat[:, :, dst.reshape(-1)] = flat[:, :, src].clone()

    def _draft_extend(
        self,
        state: StepState,
        slots: torch.Tensor,
        seq: torch.Tensor,
        vr: VerifyResult,
        feats: torch.Tensor,
        real: torch.Tensor | None,
        direct: bool,
    ) -> None:
        """Head over [L, L + Wd): row j pairs the target's feature at accepted row j with the
        token that followed it; rows past the accepted length only scribble beyond seq_len."""
        m, fm = self.models, self.future_map
        bs, w, wd = slots.shape[0], state.widths.verify, state.widths.draft
        flat = (accepted_rows(vr, wd) + torch.arange(bs, device=slots.device).unsqueeze(1) * w).reshape(-1)
        ctx = m.draft.window_context(state.widths.draft_mode, slots, seq, wd)
        g = m.run_draft(emitted_window(vr, wd).reshape(-1), ctx, feats[flat], direct)
        bonus, g_last = _kept(real, vr.bonus), _kept(real, g[last_accepted_rows(vr, wd)])
        if self.defers_guess(state):  # the next drafting iteration computes the top-k
            fm.stash(slots, RelayPayload(bonus, None, None, g_last), keep_topk=True)
            return
        p, topk = m.picker.guess(m.head, g_last, self.topk, slots, seq + vr.accept_lens + 1)
        fm.stash(slots, RelayPayload(bonus, _kept(real, p), _kept(real, topk), g_last))

    def _target_only(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """A 0-step iteration whose draft catches up later: a plain greedy decode step (the same
        ops as the plain engine's) that also publishes the new lengths and leaves the head its
        input (the target's feature, the token that followed) in the backlog ring. The relay
        reads and writes around the forward are one fused kernel each on CUDA
        (engine/relay_step.py). Emits one token per request (no "accept_lens": the host knows)."""
        m, backlog = self.models, self.backlog
        assert backlog is not None
        prefix, ids, ctx = resolve_decode(self.future_map, m.target, slots, aux_hidden_layers=m.aux_layers)
        hidden, aux = m.target.forward_direct(ids, ctx)
        tokens = m.target.model.compute_logits(hidden).argmax(-1)
        commit_decode(
            self.future_map, slots, prefix, tokens, backlog.tokens, backlog.feats, aux if m.aux_layers else [hidden]
        )
        return {"accept_lens": ctx.extend_lens, "emitted": tokens.unsqueeze(1)}


class EagleIterationGraphs:
    """An iteration's graphs, one per (padded batch size, step count) of the chain states, captured
    at start-up for the batch sizes each state can run at."""

    def __init__(self, iteration: EagleIteration, batch_sizes: list[int], capture: bool) -> None:
        self.iteration = iteration
        self._checked: tuple[list[Req], StepState, StepGraph | None] | None = None  # runs() -> run()
        fm = iteration.future_map
        # the warm-up wrote into padding rows only (all slots 0): row 0 back to zero
        self.graphs = StepGraphs(
            batch_sizes, capture=capture, after_warmup=lambda: fm.invalidate(torch.zeros(1, dtype=torch.int64))
        )

    @property
    def hits(self) -> int:
        return self.graphs.hits

    def padded(self, bs: int) -> int | None:
        return self.graphs.padded(bs)

    def shapes(self) -> list[tuple[int, int]]:
        """(step count, padded batch size) of every graph held."""
        return sorted((steps, bs) for bs, steps in self.graphs.keys())

    def captured(self) -> bool:
        """Every graph held was captured (not run padded-eager)."""
        return all(entry.graph is not None for k in self.graphs.keys() if (entry := self.graphs.get(k)))

    def prepare(self, states: list[StepState], hidden_size: int, dtype: torch.dtype) -> None:
        """Build (and on CUDA capture) every chain state's graphs for its batch sizes."""
        it = self.iteration
        it.future_map.reserve_extras(topk=1, hidden_size=hidden_size, hidden_dtype=dtype)
        device = it.models.target.device
        for state in states:
            if not state.is_chain:
                continue
            sizes = state.graph_batch_sizes if state.graph_batch_sizes is not None else self.graphs.batch_sizes
            for bs in sorted({p for b in sizes if (p := self.padded(b)) is not None}, reverse=True):
                slots = torch.zeros(bs, dtype=torch.int64, device=device)
                body = (lambda st, sl: lambda: tuple(it.run(sl, st, GRAPH_FLOW).values()))(state, slots)
                self.graphs.add((bs, state.steps), {"slots": slots}, body)

    def _entry(self, reqs: list[Req], state: StepState) -> StepGraph | None:
        if not (state.is_chain and plain_argmax_ok(reqs)):
            return None
        bs = self.padded(len(reqs))
        return self.graphs.get((bs, state.steps)) if bs is not None else None

    def runs(self, reqs: list[Req], state: StepState) -> bool:
        """`run` takes this batch (else the caller runs it eagerly). The answer is kept for the
        `run` of the same batch that follows: the per-request check is done once."""
        entry = self._entry(reqs, state)
        self._checked = (reqs, state, entry)
        return entry is not None

    def run(self, reqs: list[Req], slots: torch.Tensor, state: StepState) -> dict[str, torch.Tensor] | None:
        """The iteration's (accept_lens, emitted) rows of `reqs` through its graph, or None when
        this batch is not eligible. They are views of the graph's outputs: the caller copies them
        out (HostCopy, in stream order) before the next replay, so no device-side clone is needed."""
        checked, self._checked = self._checked, None
        hit = checked is not None and checked[0] is reqs and checked[1] is state
        entry = checked[2] if hit else self._entry(reqs, state)
        if entry is None:
            return None
        fm = self.iteration.future_map
        fm.wait_published()  # the previous iteration's publish, from any stream
        accept, emitted = self.graphs.run(entry, len(reqs), {"slots": slots})
        fm.mark_published()
        return {"accept_lens": accept, "emitted": emitted}


__all__ = ["GRAPH_FLOW", "EagleIteration", "EagleIterationGraphs", "Flow", "eager_flow"]
