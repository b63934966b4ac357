"""The draft's backlog under 0-step iterations: the target runs alone, the head catches up in bulk.

A 0-step iteration (adaptive steps chose plain decoding) needs nothing from the draft, but the
draft's KV and hidden state must be current when drafting resumes. Running the head's
draft-extend every iteration for that costs a small target a large share of its step (the head
is a full decoder layer plus launches). Instead the iteration graph writes what the draft-extend
would have read - the target's feature at position L and the token that followed it - into a
per-request ring at L mod depth, and one draft-extend over the whole backlog (`catch_up`) runs
before the request drafts again, or when its ring is full. The head's weights are read once for
up to `depth` tokens, so the draft's share of a 0-step iteration drops by about that factor.

The host knows each request's backlog exactly (a 0-step iteration advances a request by one
token), so nothing is synchronized: counts travel into the catch-up graph as an input. The
catch-up covers [max(L - depth, 0), L) in two fixed-width windows: all but the newest FULL_ROWS
positions only get the head's cache entries (its k/v projections: what later positions attend
to), the newest run the whole head, whose last hidden state seeds the next draft. Rows outside
the backlog run but write no KV (`window_context(writes=...)`), so the draft KV before the
backlog is left as it was and the backlog rows read it through the page table.

The catch-up also scores what the draft would have done: its first draft after each of the newest
backlog tokens against the token the target produced. Adaptive steps at 0 learn from that whether
drafting would pay (`StepSlot.observe_shadow`) instead of probing blind.
"""

from __future__ import annotations

import torch

from engine.core import ForwardMode
from engine.future_map import FutureMap
from engine.h2d import to_device
from engine.step_graphs import StepGraphs
from spec.eagle_draft import EagleModels

DEFAULT_DEPTH = 32  # the head's weights are read once per 32 tokens (a ring row: 32 features)
FULL_ROWS = 4  # the newest backlog rows the whole head runs on (and scores: 3 first drafts)


class DraftBacklog:
    """Per-request rings of (target feature, next token) and the catch-up that drains them."""

    def __init__(
        self,
        models: EagleModels,
        future_map: FutureMap,
        mode: ForwardMode,
        feat_width: int,
        dtype: torch.dtype,
        batch_sizes: list[int],
        *,
        capture: bool,
        depth: int | None = None,
    ) -> None:
        depth = DEFAULT_DEPTH if depth is None else depth
        if depth < 1:
            raise ValueError(f"backlog depth must be >= 1, got {depth}")
        self.models, self.future_map, self.mode, self.depth = models, future_map, mode, depth
        rows, dev = future_map.num_rows, models.target.device
        self.feats = torch.zeros(rows, depth, feat_width, dtype=dtype, device=dev)
        self.tokens = torch.zeros(rows, depth, dtype=torch.int64, device=dev)
        # rid -> tokens whose draft KV is not written yet, but for the current run: consecutive
        # 0-step iterations of one unchanged batch add one token to each of its requests, which
        # the run's length records without a per-request update (at large batches the per-rid
        # loop was a visible share of a host-bound 0-step iteration)
        self.pending: dict[str, int] = {}
        self._run: list[str] = []
        self._run_len = 0
        self._run_max = 0  # the largest folded count among the run's requests
        self.pushed = 0  # tokens left to the draft by 0-step iterations
        self.catch_ups = 0  # requests caught up (counted per request)
        self.graphs = StepGraphs(batch_sizes, capture=capture)
        for bs in reversed(self.graphs.batch_sizes):
            inputs = {
                "slots": torch.zeros(bs, dtype=torch.int64, device=dev),
                "counts": torch.zeros(bs, dtype=torch.int64, device=dev),
            }
            body = (lambda i: lambda: self._catch_up(i["slots"], i["counts"]))(inputs)
            self.graphs.add(bs, inputs, body)

    # ---- host bookkeeping ----
    def note_pushed(self, rids: list[str]) -> None:
        """A 0-step iteration of `rids` left each of them one more token (`rids` is not mutated
        afterwards: the run keeps it to compare the next batch with)."""
        self.pushed += len(rids)
        if rids != self._run:
            self._fold()
            self._run, self._run_max = rids, max((self.pending.get(r, 0) for r in rids), default=0)
        self._run_len += 1

    def full(self, rids: list[str]) -> bool:
        """Some request of `rids` has a full ring (checked every 0-step iteration: within a run
        of one batch the answer costs no per-request work)."""
        if self._run and rids == self._run:
            return self._run_max + self._run_len >= self.depth
        self._fold()
        pending, depth = self.pending, self.depth
        return any(pending.get(r, 0) >= depth for r in rids)

    def pending_of(self, rid: str) -> int:
        """Tokens of `rid` whose draft KV is not written yet (its newest positions)."""
        self._fold()
        return self.pending.get(rid, 0)

    def forget(self, rid: str) -> None:
        """A request left, or its draft state was rebuilt (prefill, PD adoption)."""
        if self._run_len and rid in self._run:  # others' counts need no fold: arrivals stay cheap
            self._fold()
        self.pending.pop(rid, None)

    def _fold(self) -> None:
        """Move the current run's tokens into the per-request counts."""
        if self._run_len:
            pending, n = self.pending, self._run_len
            for rid in self._run:
                pending[rid] = pending.get(rid, 0) + n
        self._run, self._run_len = [], 0

    # ---- the catch-up ----
    def catch_up(self, rids: list[str], slots: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Draft-extend over the backlog of every request of `rids` (at `slots`) that has one.
        Their hidden-state rows are then current; their top-k is not (the worker computes it
        before drafting). Returns, on the device, per request caught up (in `rids` order), the
        first drafts it scored against the backlog's tokens ("hits" of "samples"), or None."""
        self._fold()
        counts = [self.pending.pop(rid, 0) for rid in rids]
        keep = [i for i, c in enumerate(counts) if c > 0]
        if not keep:
            return None
        sel = slots if len(keep) == len(rids) else slots[to_device(keep, slots.device)]
        n = to_device([counts[i] for i in keep], slots.device)
        fm = self.future_map
        fm.wait_published()  # the lengths the last iteration published, from any stream
        bs = self.graphs.padded(len(keep))
        if bs is None:
            hits, samples = self._catch_up(sel, n)
        else:
            hits, samples = self.graphs.run(self.graphs.get(bs), len(keep), {"slots": sel, "counts": n})
        self.catch_ups += len(keep)
        return {"hits": hits.clone(), "samples": samples.clone()}  # the graph's outputs get reused

    def _catch_up(self, slots: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed-shape device ops (slots padded with 0, whose count is 0). The newest FULL_ROWS
        positions run the whole head (their hidden states seed the next draft and are scored);
        the backlog before them only needs the head's cache entries (`write_kv`: its k/v
        projections, no attention or MLP, about a third of the head's work per row)."""
        depth, fm, draft = self.depth, self.future_map, self.models.draft
        seq = fm.resolve_seq_lens(slots, wait=False, consume=False)
        first = (seq - counts).unsqueeze(1)  # the backlog is [seq - count, seq)
        full = min(FULL_ROWS, depth)
        tail = (seq - full).clamp(min=0)  # the whole head runs on [tail, tail + full)
        if depth > full:
            head = (seq - depth).clamp(min=0)
            pos = head.unsqueeze(1) + torch.arange(depth - full, device=slots.device)
            writes = (pos >= first) & (pos < tail.unsqueeze(1))
            tokens, feats = self._ring(slots, pos)
            ctx = draft.window_context(self.mode, slots, head, depth - full, writes=writes.reshape(-1))
            draft.model.write_kv(tokens.reshape(-1), ctx, features=feats)
        pos = tail.unsqueeze(1) + torch.arange(full, device=slots.device)
        writes = (pos >= first) & (pos < seq.unsqueeze(1))
        tokens, feats = self._ring(slots, pos)
        ctx = draft.window_context(self.mode, slots, tail, full, writes=writes.reshape(-1))
        g = draft.forward_direct(tokens.reshape(-1), ctx, features=feats)
        bs = slots.shape[0]
        last = torch.arange(bs, device=slots.device) * full + (seq - 1 - tail).clamp(min=0)
        g_last = torch.where((counts > 0).unsqueeze(1), g[last], 0)  # padding keeps row 0 zero
        fm.stash_hidden(slots, g_last)
        return self._first_draft_hits(g, slots, pos, tokens, writes)

    def _ring(self, slots: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (bs, w), features (bs * w, F)) the ring holds for positions `pos` (bs, w)."""
        rows, at = slots.unsqueeze(1), pos % self.depth
        return self.tokens[rows, at], self.feats[rows, at].reshape(-1, self.feats.shape[-1])

    def _first_draft_hits(
        self, g: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, writes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first draft a drafting iteration would have made after each of the newest backlog
        rows but the last (the top-1 of that row's hidden state `g`) against the token the target
        then produced (the next row's): per request, (hits, samples). Only the rows the whole
        head ran on are scored: the head's logits over every row cost a third of a catch-up at
        large batch sizes, and a few samples per request and catch-up steer the policy as well."""
        m = self.models
        bs, width = pos.shape
        # `pick` is `guess`'s top-1 without the softmax (pickers agree on it: tested)
        first = m.picker.pick(m.head, g, slots.repeat_interleave(width), (pos + 2).reshape(-1)).view(bs, width)
        scored = writes[:, :-1] & writes[:, 1:]
        hits = ((first[:, :-1] == tokens[:, 1:]) & scored).sum(1)
        return hits, scored.sum(1)


__all__ = ["DEFAULT_DEPTH", "DraftBacklog"]
