"""Shared by every verifying worker: verify a window's logits, then turn the result into a step."""

from __future__ import annotations

import torch

from engine.core import Req, StepOutput
from engine.grammar.bitmask import MaskRows, window_masks
from engine.h2d import to_device
from engine.sampler import Sampler
from engine.spec_stats import SpecStats
from spec.tree import DraftTree
from spec.rejection import VerifyResult, verify_greedy, verify_sampled


def verify_window(
    sampler: Sampler, reqs: list[Req], tree: DraftTree, logits: torch.Tensor, seq_lens: torch.Tensor
) -> VerifyResult:
    """logits: (bs * ntok, V) target logits over the window rows."""
    bs, ntok = tree.tokens.shape
    # min_new_tokens bans depend on the index each row samples: seq_len + 1 + its depth (exact on
    # the device, for trees and under overlap, where the host's output_ids lag)
    rows_at = (
        (seq_lens.unsqueeze(1) + 1 + tree.depth).reshape(-1) if any(r.params.min_new_tokens for r in reqs) else None
    )
    sb = sampler.prepare(reqs, rows_per_req=ntok, row_positions=rows_at, grammar=grammar_rows(sampler, reqs, tree))
    if sb.all_greedy:  # the (penalised) argmax per row is all greedy verification needs
        return verify_greedy(tree, sampler.sample(logits, sb).tokens.view(bs, ntok))
    probs = sampler.processed_probs(logits, sb).view(bs, ntok, -1)
    seeds = to_device([r.sampling_seed for r in reqs], seq_lens.device)  # pinned: no host sync
    return verify_sampled(tree, probs, seeds, seq_lens + 1)  # + 1: index of the first new token


def grammar_rows(sampler: Sampler, reqs: list[Req], tree: DraftTree) -> MaskRows | None:
    """Constrained requests' masks at every window row: their drafts walked through the matcher
    (which ends where it took them: rolled back). A draft token the grammar refuses gets a zero
    probability at its parent's row, so neither greedy nor sampled verification accepts it or
    anything drafted under it, and the bonus there is drawn from the masked distribution. The
    walk needs the drafts on the host: one copy per constrained verify (unconstrained batches
    skip it)."""
    if all(r.live_grammar is None for r in reqs):
        return None
    tokens, parents = torch.stack((tree.tokens, tree.parents)).tolist()  # one copy
    return window_masks([r.live_grammar for r in reqs], tokens, parents, sampler.vocab_size, sampler.device)


def accepted_rows(vr: VerifyResult, ntok: int) -> torch.Tensor:
    """Window rows of the accepted path, padded to `ntok` with the last accepted row."""
    bs, width = vr.path.shape
    last = torch.gather(vr.path, 1, (vr.accept_lens - 1).unsqueeze(1))
    path = torch.where(vr.path >= 0, vr.path, last)
    if width < ntok:
        path = torch.cat((path, last.expand(bs, ntok - width)), dim=1)
    return path[:, :ntok]


def step_output(
    sampler: Sampler,
    stats: SpecStats,
    reqs: list[Req],
    vr: VerifyResult,
    logits: torch.Tensor,
    rows: torch.Tensor,
    drafts: int | None = None,
) -> StepOutput:
    """Record penalties and stats; one CPU copy of the emitted tokens (+ logprobs if asked)."""
    return host_output(stats, emit_device(sampler, reqs, vr, logits, rows), drafts)


def emit_device(
    sampler: Sampler, reqs: list[Req], vr: VerifyResult, logits: torch.Tensor, rows: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The device half: record penalties, compute logprobs; returns what the host will read."""
    sampler.record(reqs, vr.emitted.clamp(min=0), counts=vr.accept_lens)
    out = {"accept_lens": vr.accept_lens, "emitted": vr.emitted}
    n_top = max((r.params.top_logprobs for r in reqs), default=0)
    if any(r.params.logprobs for r in reqs) or n_top:
        # Emitted token j was chosen from the target's distribution at accepted row j: its
        # logprob and the top-n there are the target's (raw logits, as plain sampling reports).
        bs, ntok = rows.shape
        width = vr.emitted.shape[1]
        flat = (rows[:, :width] + torch.arange(bs, device=rows.device).unsqueeze(1) * ntok).reshape(-1)
        lp = torch.log_softmax(logits[flat].float(), -1).view(bs, width, -1)
        out["logprobs"] = torch.gather(lp, 2, vr.emitted.clamp(min=0).unsqueeze(2)).squeeze(2)
        if n_top:
            out["top_values"], out["top_ids"] = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)
    return out


def host_output(stats: SpecStats, host: dict[str, torch.Tensor], drafts: int | None = None) -> StepOutput:
    """The host half, once the copies of `emit_device`'s tensors arrived; `drafts`: drafts per
    request along the longest path of this step (default: the stats' configured maximum).
    Without "accept_lens", every request emitted one token (a 0-step iteration)."""
    if "accept_lens" not in host:
        tokens = host["emitted"].tolist()
        stats.record_uniform(1, len(tokens), drafts)
        return StepOutput(tokens=tokens, accepted_drafts=[0] * len(tokens))
    accept = host["accept_lens"].tolist()
    stats.record(accept, drafts)
    out = StepOutput(
        tokens=[e[:a] for e, a in zip(host["emitted"].tolist(), accept)], accepted_drafts=[a - 1 for a in accept]
    )
    if "logprobs" in host:
        out.logprobs = [c[:a] for c, a in zip(host["logprobs"].tolist(), accept)]
    if "top_ids" in host:
        out.top_logprobs = [
            [list(zip(ids[j], vals[j])) for j in range(a)]
            for ids, vals, a in zip(host["top_ids"].tolist(), host["top_values"].tolist(), accept)
        ]
    return out
