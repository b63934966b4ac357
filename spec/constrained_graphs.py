"""Whole EAGLE iterations of constrained batches: two CUDA graphs around the host's grammar walk.

A constrained request's mask at a window row is its grammar's state after the drafts on the path
to that row, and only the host's matcher can walk them. So the iteration is split where that walk
goes. Graph A resolves the FutureMap rows and drafts the chain. The host reads the drafts (one
copy), puts the tokens the grammar forces first (jump-forward), and packs the tokens each row
forbids. Graph B verifies under those masks (a greedy argmax), publishes the new lengths,
draft-extends and stashes. Run eagerly, the same iteration launches hundreds of small kernels
around the forwards' graphs: on an H100 the GPU sat idle for over half of each constrained
iteration of the 8B shape at batch 1 (bench/RESULTS.md, grammars), for the same GPU work.

Batches run here are chain states whose requests are greedy with no penalties, min_tokens, logit
bias or logprobs (`masked_argmax_ok`), at least one of them constrained; the others take the
unconstrained whole-iteration graphs or run eagerly, with the same results. Like those graphs, the
pair also runs uncaptured on the padded buffers off CUDA, which is how the CPU tests check it.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.core import Req
from engine.grammar.base import mask_words
from engine.grammar.bitmask import ban_tokens, window_banned
from engine.h2d import to_device
from engine.sampler import masked_argmax_ok
from engine.step_graphs import Body, StepGraphs
from spec.eagle_iteration import EagleIteration, Flow, Verifier
from spec.eagle_steps import StepState
from spec.jump_forward import force_drafts_on_host
from spec.rejection import VerifyResult, verify_greedy
from spec.tree import DraftTree

DRAFT, VERIFY = "draft", "verify"
# Constrained batches larger than this run eagerly: each graph pair doubles a size's capture time,
# and the verify graph holds a (window rows x vocabulary) mask expansion.
MAX_BATCH = 64


def masked_greedy(banned: torch.Tensor) -> Verifier:
    """Greedy verification with each window row's forbidden tokens at -inf (banned: bs, ntok, words)."""

    def verify(tree: DraftTree, logits: torch.Tensor, seq: torch.Tensor) -> VerifyResult:
        masked = ban_tokens(logits, banned.view(logits.shape[0], -1))
        return verify_greedy(tree, masked.argmax(-1).view(tree.tokens.shape))

    return verify


def _accepted(vr: VerifyResult, logits: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accept_lens": vr.accept_lens, "emitted": vr.emitted}


class ConstrainedIterationGraphs:
    """Per (padded batch size, step count) of the chain states: a draft graph and a verify graph."""

    def __init__(self, iteration: EagleIteration, batch_sizes: list[int], capture: bool, vocab_size: int) -> None:
        self.iteration, self.vocab_size = iteration, vocab_size
        fm = iteration.future_map
        sizes = [b for b in batch_sizes if b <= MAX_BATCH]
        zero_row_0 = lambda: fm.invalidate(torch.zeros(1, dtype=torch.int64))  # noqa: E731 - warm-up wrote row 0
        self.graphs = StepGraphs(sizes, capture=capture, after_warmup=zero_row_0)
        self.iterations = 0  # iterations served (each replays both graphs)

    def prepare(self, states: list[StepState]) -> None:
        """Build (and on CUDA capture) both graphs of every chain state for its batch sizes."""
        device = self.iteration.models.target.device
        words = mask_words(self.vocab_size)
        for state in states:
            if not state.is_chain:
                continue
            sizes = state.graph_batch_sizes if state.graph_batch_sizes is not None else self.graphs.batch_sizes
            width = state.widths.verify
            for bs in sorted({p for b in sizes if (p := self.graphs.padded(b)) is not None}, reverse=True):
                slots = torch.zeros(bs, dtype=torch.int64, device=device)
                self.graphs.add((DRAFT, bs, state.steps), {"slots": slots}, self._draft_body(state, slots))
                inputs = {
                    "slots": torch.zeros(bs, dtype=torch.int64, device=device),
                    "seq": torch.zeros(bs, dtype=torch.int64, device=device),
                    "tokens": torch.zeros(bs, width, dtype=torch.int64, device=device),
                    "banned": torch.zeros(bs, width, words, dtype=torch.int32, device=device),  # 0: none
                }
                self.graphs.add((VERIFY, bs, state.steps), inputs, self._verify_body(state, inputs))

    def _draft_body(self, state: StepState, slots: torch.Tensor) -> Body:
        def body() -> tuple[torch.Tensor, ...]:
            seq, tree = self.iteration.draft(slots, state, direct=True)
            return seq, tree.tokens

        return body

    def _verify_body(self, state: StepState, inputs: dict[str, torch.Tensor]) -> Body:
        flow = Flow(captured=True, verify=masked_greedy(inputs["banned"]), emit=_accepted)
        width = state.widths.verify

        def body() -> tuple[torch.Tensor, ...]:
            tree = DraftTree(inputs["tokens"], is_chain=True, depth_bound=width - 1, branching=1)
            out = self.iteration.verify_and_extend(inputs["slots"], state, inputs["seq"], tree, flow)
            return out["accept_lens"], out["emitted"]

        return body

    def run(
        self, reqs: list[Req], slots: torch.Tensor, state: StepState, settle: Callable[[], None]
    ) -> dict[str, torch.Tensor] | None:
        """The iteration's (accept_lens, emitted) rows of `reqs` (views of graph B's outputs: the
        caller copies them out before the next replay), or None when the batch is not eligible.
        `settle` brings the batch in flight's tokens into the matchers: called once graph A is
        enqueued, so the host's collect runs while the device drafts."""
        if not state.is_chain or all(r.grammar is None for r in reqs) or not masked_argmax_ok(reqs):
            return None
        bs = self.graphs.padded(len(reqs))
        draft = self.graphs.get((DRAFT, bs, state.steps)) if bs is not None else None
        verify = self.graphs.get((VERIFY, bs, state.steps)) if bs is not None else None
        if draft is None or verify is None:
            return None
        n, fm = len(reqs), self.iteration.future_map
        fm.wait_published()  # the previous iteration's publish, from any stream
        seq, tokens = self.graphs.run(draft, n, {"slots": slots})
        settle()
        window = tokens.tolist()  # the one copy (and sync): the matchers walk the drafts
        force_drafts_on_host(reqs, window)
        chain = [list(range(-1, len(window[0]) - 1))] * n  # row r's parent is row r - 1
        banned = window_banned([r.live_grammar for r in reqs], window, chain, self.vocab_size)
        device = slots.device
        values = {"slots": slots, "seq": seq, "tokens": to_device(window, device), "banned": _staged(banned, device)}
        accept, emitted = self.graphs.run(verify, n, values)
        fm.mark_published()
        self.iterations += 1
        return {"accept_lens": accept, "emitted": emitted}


def _staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` through pinned memory (queued behind the work in flight)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
