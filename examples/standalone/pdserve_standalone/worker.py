"""The STANDALONE worker: a small draft LM drafts a chain, the target verifies it, the draft LM
catches up over the verified window.

The draft LM keeps its KV at the target's slots one token ahead (slot j holds the draft's view of
token j + 1, at rotary position j: rotary attention only sees relative positions, so the shift
costs nothing; token 0 is the one token it never reads), so its KV pages move with the target's
under the same page ids, and after any step it has already read the bonus token: its prediction
after the bonus is the next verify's first draft, relayed (with the bonus) through the FutureMap.

Decode: resolve -> the relayed first draft, then `width - 2` draft-LM decode steps for the rest
of the chain -> TARGET_VERIFY over `width` rows -> exact acceptance -> publish -> the draft LM
over the emitted tokens in one fixed-width window (TARGET_VERIFY shape) -> stash its top-1 after
the new bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spec.api import (
    Batch,
    BatchRelay,
    DecodePlan,
    EngineParts,
    ForwardMode,
    HandoffCodec,
    HostCopy,
    KVPool,
    ModelRunner,
    RelayPayload,
    Sampler,
    SpecConfig,
    SpecConfigError,
    SpecStats,
    StepOutput,
    WorkerBase,
    accepted_rows,
    build_input_ids,
    chain_tree,
    emit_device,
    emitted_window,
    host_output,
    last_accepted_rows,
    last_token_rows,
    load_model,
    maybe_enable_cuda_graphs,
    offer_forced_drafts,
    sample_positions,
    sample_tokens,
    sampled_output,
    sampling_reqs,
    scatter_to_batch,
    shifted_tokens,
    to_device,
    verify_window,
)
from pdserve_standalone.handoff import DraftGuess, GuessCodec


@dataclass
class Pending:
    batch: Batch
    copy: HostCopy | None
    widths: tuple[int, int] = (0, 0)  # decode: (verify, draft) widths it ran with


def top1(runner: ModelRunner, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, token) of the draft LM's most likely next token per row, each (n, 1)."""
    probs = torch.softmax(runner.logits(hidden).float(), dim=-1)
    return torch.topk(probs, 1, dim=-1)


class StandaloneWorker(WorkerBase):
    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner,
        sampler: Sampler,
        width: int,
        draft_width: int,
        draft_mode: ForwardMode,
    ) -> None:
        super().__init__(target, sampler)
        self.target, self.draft = target, draft
        self.width, self.draft_width, self.draft_mode = width, draft_width, draft_mode
        self.stats = SpecStats(max_drafts=width - 1)

    @classmethod
    def create(cls, parts: EngineParts, cfg: SpecConfig, algorithm: Any) -> "StandaloneWorker":
        width = algorithm.get_num_tokens_per_req_for_target_verify(cfg.ntok, False)
        draft_width = algorithm.get_num_tokens_per_req_for_target_verify(cfg.ntok, True)
        if width < 2 or draft_width < width:
            raise SpecConfigError(
                f"{algorithm.name}: verify width {width} and draft width {draft_width} need 2 <= verify <= draft"
            )
        assert cfg.draft_model_path is not None
        model, mcfg = load_model(cfg.draft_model_path, parts.dtype, parts.device)
        if mcfg.vocab_size != parts.model_config.vocab_size:
            raise SpecConfigError(
                f"--speculative-draft-model-path: the draft LM's vocabulary ({mcfg.vocab_size}) "
                f"is not the target's ({parts.model_config.vocab_size})"
            )
        pool = KVPool(
            mcfg.num_layers,
            parts.kv.allocator.num_pages,
            parts.kv.page_size,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            parts.dtype,
            parts.device,
        )
        allowed = algorithm.supports_target_verify_for_draft()
        draft = ModelRunner(
            model,
            parts.kv,
            pool,
            parts.runner.attn_backend,
            parts.device,
            target_verify=True if allowed else "its algorithm keeps the draft in DRAFT_EXTEND",
        )
        maybe_enable_cuda_graphs(draft, parts.config.cuda_graph_max_bs, parts.config.cuda_graph_padded_eager)
        mode = ForwardMode.TARGET_VERIFY if allowed else ForwardMode.DRAFT_EXTEND
        return cls(parts.runner, draft, parts.sampler, width, draft_width, mode)

    # ---- the hooks it changes (the rest are WorkerBase's) ----
    def kv_tokens_per_decode(self) -> int:
        return max(self.width, self.draft_width)

    def activate_step_by_batch(self, batch_size: int) -> int:
        return self.width - 1

    def plan_decode(self, batch_size: int, room: int) -> DecodePlan:
        """The configured widths, narrower near the context limit; (verify, draft) travel with the batch."""
        w = max(1, min(self.activate_step_by_batch(batch_size) + 1, room))
        widths = (w, max(w, min(self.draft_width, room)))
        return DecodePlan(max(widths), w - 1, widths)

    def capture_cuda_graphs(self) -> None:
        self.target.capture(ForwardMode.TARGET_VERIFY, self.width)
        self.draft.capture(self.draft_mode, self.draft_width)
        if self.width > 2:
            self.draft.capture(ForwardMode.DECODE, 1)
        self.target.freeze_graphs()
        self.draft.freeze_graphs()

    def extra_kv_pools(self) -> list[KVPool]:
        return [self.draft.pool]

    def handoff_codec(self) -> HandoffCodec:
        return GuessCodec()

    def spec_stats(self) -> SpecStats:
        return self.stats

    @torch.inference_mode()
    def launch(self, batch: Batch, relay: BatchRelay) -> Pending:
        return self._prefill(batch, relay) if batch.mode is ForwardMode.EXTEND else self._decode(batch, relay)

    def collect(self, pending: Pending) -> StepOutput:
        if pending.copy is None:
            return StepOutput(tokens=[[] for _ in pending.batch.reqs])
        if pending.batch.mode is ForwardMode.EXTEND:
            return scatter_to_batch(sampled_output(pending.copy.wait()), pending.batch.sample)
        return host_output(self.stats, pending.copy.wait(), pending.widths[0] - 1)

    # ---- prefill: the target over the chunk, the draft LM over it shifted by one ----
    def _prefill(self, batch: Batch, relay: BatchRelay) -> Pending:
        dev, slots = self.target.device, [r.slot for r in batch.reqs]
        ctx = self.target.make_context(ForwardMode.EXTEND, slots, batch.prefix_lens, batch.extend_lens)
        hidden, _ = self.target.forward(build_input_ids(batch, dev), ctx)
        sampling, rows = sampling_reqs(batch), last_token_rows(batch, dev)
        shifted = to_device(shifted_tokens(batch), dev)
        out, done = None, relay.select(batch.sample)
        if sampling:
            out = sample_tokens(self.sampler, self.target.logits(hidden[rows]), sampling, sample_positions(batch))
            shifted[rows] = out["tokens"]
            ends = [p + n for p, n, s in zip(batch.prefix_lens, batch.extend_lens, batch.sample) if s]
            done.on_publish(to_device(ends, dev))
        dctx = self.draft.make_context(ForwardMode.DRAFT_EXTEND, slots, batch.prefix_lens, batch.extend_lens)
        g, _ = self.draft.forward(shifted, dctx)
        if out is None:
            return Pending(batch, None)
        p, tok = top1(self.draft, g[rows])
        done.stash(RelayPayload(out["tokens"], p, tok))
        for i, req in enumerate(sampling):
            if req.hold_kv:  # PD prefill: the guess travels in the handoff row
                req.spec_state = DraftGuess(p[i], tok[i])
        return Pending(batch, HostCopy(out))

    # ---- decode ----
    def _decode(self, batch: Batch, relay: BatchRelay) -> Pending:
        reqs, (w, wd) = batch.reqs, batch.plan.state
        bs, slots, bound = len(reqs), [r.slot for r in reqs], batch.prefix_lens
        seq = relay.resolve_seq_lens()
        r = relay.resolve()
        tok = r.topk_index[:, 0]
        chain = [r.bonus_tokens, tok]
        for s in range(1, w - 1):  # draft token s sits at slot seq + s - 1 (one ahead)
            ctx = self.draft.make_context(
                ForwardMode.DECODE,
                slots,
                [b + s - 1 for b in bound],
                [1] * bs,
                device_prefix=seq + s - 1,
                positions=seq + s - 1,
            )
            g, _ = self.draft.forward(tok, ctx)
            tok = self.draft.logits(g).argmax(-1)
            chain.append(tok)
        # a constrained request drafts what its grammar forces first (jump-forward)
        tree = offer_forced_drafts(reqs, chain_tree(torch.stack(chain, dim=1)[:, :w]))
        ctx = self.target.make_context(ForwardMode.TARGET_VERIFY, slots, bound, [w] * bs, device_prefix=seq)
        hidden, _ = self.target.forward(tree.tokens.reshape(-1), ctx)
        logits = self.target.logits(hidden)
        vr = verify_window(self.sampler, reqs, tree, logits, seq)
        relay.on_publish(seq + vr.accept_lens)
        dctx = self.draft.make_context(self.draft_mode, slots, bound, [wd] * bs, device_prefix=seq)
        g, _ = self.draft.forward(emitted_window(vr, wd).reshape(-1), dctx)
        p, tok = top1(self.draft, g[last_accepted_rows(vr, wd)])
        relay.stash(RelayPayload(vr.bonus, p, tok))
        return Pending(batch, HostCopy(emit_device(self.sampler, reqs, vr, logits, accepted_rows(vr, w))), (w, wd))
