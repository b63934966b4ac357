"""A whole EAGLE chain iteration as one CUDA graph per (padded batch size, step count).

Resolve the batch's FutureMap rows -> draft steps -> TARGET_VERIFY -> greedy acceptance ->
publish the new lengths -> draft-extend -> stash, all device ops with fixed shapes: contexts are
built on the device from the resolved lengths (ModelRunner.window_context), so the host's part of
an iteration is one copy of the slot indices, one replay and the copy of the results. Between
separately replayed forward graphs the host otherwise spends milliseconds on the small ops this
graph now holds, which on a small target costs more than the GPU work itself.

Eligible batches: a chain state (topk 1, or zero drafts), every request greedy without penalties,
min_tokens, logit_bias or logprobs (those take the eager path, same results), a batch size up to
the largest captured graph. The same body runs uncaptured on the padded static buffers (CPU
tests), which is what makes "graphs equal eager" testable without a GPU. Padded rows read and
write FutureMap row 0, kept at zero, and KV page 0, reserved for padding.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.core import ForwardMode, Req
from engine.future_map import FutureMap, RelayPayload
from engine.relay_step import commit_decode, resolve_decode
from engine.sampler import plain_argmax_ok as graphable
from engine.step_graphs import StepGraph, StepGraphs
from spec.verify_step import accepted_rows
from spec.eagle_steps import StepState
from spec.rejection import chain_greedy
from spec.windows import emitted_window, last_accepted_rows

if TYPE_CHECKING:
    from spec.eagle_worker import EagleWorker

log = logging.getLogger(__name__)


def chain_iteration(worker: "EagleWorker", state: StepState, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration for the requests at `slots` (padded with 0); returns (accept_lens, emitted).
    The eager path's ops (EagleWorker._decode) on device-built contexts, for chains."""
    if worker.pushes_backlog(state):
        return target_only_iteration(worker, slots)
    fm, picker = worker.future_map, worker.picker
    target, draft, head = worker.target, worker.draft, worker.draft.model
    real = slots != 0
    seq = fm.resolve_seq_lens(slots, wait=False)
    relay = fm.resolve(slots, wait=False)
    w, wd, drafts = state.widths.verify, state.widths.draft, state.widths.drafts
    tok, feats = relay.topk_index[:, 0], relay.hidden_states
    chain = [relay.bonus_tokens, tok]
    for step in range(1, drafts):  # draft `step` (at position seq + step) is fed, one slot back
        ctx = draft.window_context(ForwardMode.DECODE, slots, seq + step - 1, 1)
        feats = draft.forward_direct(tok, ctx, features=feats)
        tok = picker.pick(head, feats, slots, seq + step + 1)
        chain.append(tok)
    window = torch.stack(chain, dim=1)[:, :w]
    ctx = target.window_context(ForwardMode.TARGET_VERIFY, slots, seq, w, aux_hidden_layers=worker.aux_layers)
    hidden, aux = target.forward_direct(window.reshape(-1), ctx)
    picks = target.model.compute_logits(hidden).argmax(-1).view(-1, w)
    vr = chain_greedy(window, picks)
    fm.publish(slots, torch.where(real, seq + vr.accept_lens, 0), record=False)
    feats_t = worker.features(hidden, aux)
    bs = slots.shape[0]
    flat = (accepted_rows(vr, wd) + torch.arange(bs, device=slots.device).unsqueeze(1) * w).reshape(-1)
    ctx = draft.window_context(state.widths.draft_mode, slots, seq, wd)
    g = draft.forward_direct(emitted_window(vr, wd).reshape(-1), ctx, features=feats_t[flat])
    g_last = g[last_accepted_rows(vr, wd)]
    keep = real.unsqueeze(1)
    bonus, g_last = torch.where(real, vr.bonus, 0), torch.where(keep, g_last, 0)
    if worker.defers_guess(state):  # the next drafting iteration computes the top-k
        fm.stash(slots, RelayPayload(bonus, None, None, g_last), keep_topk=True)
        return vr.accept_lens, vr.emitted
    p, topk = picker.guess(head, g_last, 1, slots, seq + vr.accept_lens + 1)
    fm.stash(slots, RelayPayload(bonus, torch.where(keep, p, 0), torch.where(keep, topk, 0), g_last))
    return vr.accept_lens, vr.emitted


def target_only_iteration(worker: "EagleWorker", slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 0-step iteration whose draft catches up later: a plain greedy decode step (the same
    ops as the plain engine's) that also publishes the new lengths and leaves the head its
    input (the target's feature, the token that followed) in the backlog ring. The relay reads
    and writes around the forward are one fused kernel each on CUDA (engine/relay_step.py)."""
    target, backlog = worker.target, worker.backlog
    assert backlog is not None
    prefix, ids, ctx = resolve_decode(worker.future_map, target, slots, aux_hidden_layers=worker.aux_layers)
    hidden, aux = target.forward_direct(ids, ctx)
    tokens = target.model.compute_logits(hidden).argmax(-1)
    commit_decode(
        worker.future_map, slots, prefix, tokens, backlog.tokens, backlog.feats, aux if worker.aux_layers else [hidden]
    )
    return ctx.extend_lens, tokens.unsqueeze(1)  # one token each: extend_lens is that constant


class EagleIterationGraphs:
    """The iteration graphs of one worker: captured at start-up for the states' batch sizes."""

    def __init__(self, worker: "EagleWorker", batch_sizes: list[int], capture: bool) -> None:
        self.worker = worker
        self._checked: tuple[list[Req], StepState, StepGraph | None] | None = None  # runs() -> run()
        # the warm-up wrote into padding rows only (all slots 0): row 0 back to zero
        self.graphs = StepGraphs(
            batch_sizes,
            capture=capture,
            after_warmup=lambda: worker.future_map.invalidate(torch.zeros(1, dtype=torch.int64)),
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
        return all(self.graphs.get(k).graph is not None for k in self.graphs.keys())

    def prepare(self, states: list[StepState], future_map: FutureMap, hidden_size: int, dtype: torch.dtype) -> None:
        """Build (and on CUDA capture) every eligible state's graphs for its batch sizes."""
        future_map.reserve_extras(topk=1, hidden_size=hidden_size, hidden_dtype=dtype)
        device = self.worker.target.device
        for state in states:
            if not state.is_chain:
                continue
            sizes = state.graph_batch_sizes if state.graph_batch_sizes is not None else self.graphs.batch_sizes
            for bs in sorted({p for b in sizes if (p := self.padded(b)) is not None}, reverse=True):
                slots = torch.zeros(bs, dtype=torch.int64, device=device)
                body = (lambda st, sl: lambda: chain_iteration(self.worker, st, sl))(state, slots)
                self.graphs.add((bs, state.steps), {"slots": slots}, body)

    def _entry(self, reqs: list[Req], state: StepState) -> StepGraph | None:
        if not (state.is_chain and graphable(reqs)):
            return None
        bs = self.padded(len(reqs))
        return self.graphs.get((bs, state.steps)) if bs is not None else None

    def runs(self, reqs: list[Req], state: StepState) -> bool:
        """`run` takes this batch (else the caller runs the eager path). The answer is kept for
        the `run` of the same batch that follows: the per-request check is done once."""
        entry = self._entry(reqs, state)
        self._checked = (reqs, state, entry)
        return entry is not None

    def run(self, reqs: list[Req], slots: torch.Tensor, state: StepState) -> dict[str, torch.Tensor] | None:
        """The iteration's (accept_lens, emitted) rows of `reqs` through its graph, or None when
        this batch is not eligible (the caller runs the eager path). They are views of the
        graph's outputs: the caller copies them out (HostCopy, in stream order) before the next
        replay, so no device-side clone is needed."""
        checked, self._checked = self._checked, None
        hit = checked is not None and checked[0] is reqs and checked[1] is state
        entry = checked[2] if hit else self._entry(reqs, state)
        if entry is None:
            return None
        fm = self.worker.future_map
        fm.wait_published()  # the previous iteration's publish, from any stream
        accept, emitted = self.graphs.run(entry, len(reqs), {"slots": slots})
        fm.mark_published()
        return {"accept_lens": accept, "emitted": emitted}
