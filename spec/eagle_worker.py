"""The EAGLE worker: an Executor that drafts, verifies with the target, and draft-extends.

Prefill (EXTEND): the target runs the prompt chunk; the head runs over the same positions
with tokens shifted left by one (the last one is the next prompt token, or the sampled bonus
when the chunk ends the prompt), writing draft KV at the target's slots. A finished prompt
leaves its top-k and draft hidden state on the request: exactly what a PD decode node gets.

Decode: draft a tree -> TARGET_VERIFY over `ntok` rows -> accept (spec.verify) -> move the
accepted rows' target KV to the front of the window (trees only) -> draft-extend over a
constant-width window (accepted rows first) and keep the head's state at the last accepted row.
`seq_len` grows by accept_len = correct drafts + 1; the new bonus token has no KV.
"""

from __future__ import annotations

import torch

from engine.core import Batch, ForwardMode, Req, StepOutput
from engine.engine import EngineParts
from engine.executor import build_input_ids, last_token_rows, sample_output, scatter_to_batch
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from spec.accept import accepted_rows, step_output, verify_window
from spec.config import SpecConfig
from spec.draft_input import EagleDraftInput, EagleReqState, EagleVerifyInput
from spec.eagle_draft import build_draft_tree, draft_topk
from spec.metrics import SpecStats
from spec.verify import VerifyResult


class EagleWorker:
    def __init__(self, target: ModelRunner, draft: ModelRunner, sampler: Sampler, config: SpecConfig,
                 aux_layers: tuple[int, ...]) -> None:
        self.target, self.draft, self.sampler = target, draft, sampler
        self.cfg = config
        self.aux_layers = aux_layers  # EAGLE-3: target layers whose inputs feed the head
        self.stats = SpecStats(max_drafts=config.num_steps)

    @classmethod
    def create(cls, parts: EngineParts, config: SpecConfig, fmt: str) -> "EagleWorker":
        from engine.draft_loader import load_draft_model

        assert config.draft_model_path is not None
        head, hcfg, aux = load_draft_model(config.draft_model_path, fmt, parts.runner.model,
                                           parts.model_config, parts.dtype, parts.device)
        pool = KVPool(hcfg.num_layers, parts.kv.allocator.num_pages, parts.kv.page_size,
                      hcfg.num_kv_heads, hcfg.head_dim, parts.dtype, parts.device)
        draft = ModelRunner(head, parts.kv, pool, parts.runner.attn_backend, parts.device)
        return cls(parts.runner, draft, parts.sampler, config, aux)

    # ---- Executor protocol ----
    def kv_tokens_per_decode(self) -> int:
        return max(self.cfg.ntok, self.cfg.num_steps * self.cfg.eagle_topk)

    def on_admit(self, req: Req) -> None:
        self.sampler.on_admit(req)

    def extra_kv_pools(self) -> list[KVPool]:
        """PD: the draft KV moves with the target's, by the same page ids."""
        return [self.draft.pool]

    def handoff_hidden(self) -> tuple[int, torch.dtype]:
        """PD: width and dtype of the draft hidden state carried in the aux row."""
        return self.draft.model.config.hidden_size, self.draft.pool.buffer.dtype

    def on_release(self, req: Req) -> None:
        req.spec_state = None

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput:
        if batch.mode is ForwardMode.EXTEND:
            return self._prefill(batch)
        return self._decode(batch)

    # ---- prefill ----
    def _features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(aux, dim=-1) if self.aux_layers else hidden

    def _prefill(self, batch: Batch) -> StepOutput:
        reqs, lens = batch.reqs, batch.extend_lens
        slots, prefix = [r.slot for r in reqs], [r.seq_len for r in reqs]
        ctx = self.target.make_context(ForwardMode.EXTEND, slots, prefix, lens,
                                       aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.forward(build_input_ids(batch, self.target.device), ctx)
        feats = self._features(hidden, aux)
        sampling = [r for r, s in zip(reqs, batch.sample) if s]
        out = StepOutput(tokens=[[] for _ in reqs])
        rows = last_token_rows(ctx.qo_indptr, batch.sample)
        if sampling:
            sampled = sample_output(self.sampler, self.target.logits(hidden[rows]), sampling)
            out = scatter_to_batch(sampled, batch.sample)
        # draft-extend over the chunk, tokens shifted left by one
        shifted: list[int] = []
        for req, n, new in zip(reqs, lens, out.tokens):
            shifted.extend(req.tokens(req.seq_len + 1, req.seq_len + n))
            shifted.append(new[0] if new else req.tokens(req.seq_len + n, req.seq_len + n + 1)[0])
        dctx = self.draft.make_context(ForwardMode.DRAFT_EXTEND, slots, prefix, lens)
        g = self.draft.forward(torch.tensor(shifted, device=self.target.device), dctx, features=feats)
        if sampling:
            g_last = g[rows]
            p, idx = draft_topk(self.draft.model, g_last, self.cfg.eagle_topk)
            for i, req in enumerate(sampling):
                req.spec_state = EagleReqState(p[i], idx[i], g_last[i])
        return out

    # ---- decode ----
    def _decode(self, batch: Batch) -> StepOutput:
        reqs = batch.reqs
        bs, ntok = len(reqs), self.cfg.ntok
        dev = self.target.device
        slots, seq_lens = [r.slot for r in reqs], [r.seq_len for r in reqs]
        seq = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        bonus = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=dev)
        di = EagleDraftInput.stack([r.spec_state for r in reqs], bonus)
        tree = build_draft_tree(self.draft, di, slots, seq_lens, self.cfg.num_steps,
                                self.cfg.eagle_topk, ntok)
        vi = EagleVerifyInput.from_tree(tree, seq)
        ctx = self.target.make_context(ForwardMode.TARGET_VERIFY, slots, seq_lens, [ntok] * bs,
                                       positions=vi.positions, tree_mask=vi.tree_mask,
                                       aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.forward(tree.tokens.reshape(-1), ctx)
        logits = self.target.logits(hidden)
        vr = verify_window(self.sampler, reqs, tree, logits, seq)
        rows = accepted_rows(vr, ntok)  # (bs, ntok) window rows, accepted first
        if not tree.is_chain:
            self._compact_target_kv(slots, seq, rows, vr.accept_lens)
        self._draft_extend(reqs, slots, seq_lens, rows, vr, self._features(hidden, aux))
        return step_output(self.sampler, self.stats, reqs, vr, logits, rows)

    def _compact_target_kv(self, slots: list[int], seq: torch.Tensor, rows: torch.Tensor,
                           accept_lens: torch.Tensor) -> None:
        """Tree verify wrote KV in tree order; move the accepted path's KV to [L, L + accept_len)."""
        table = self.target.kv.req_to_token
        slot_t = torch.tensor(slots, device=seq.device).unsqueeze(1)
        j = torch.arange(rows.shape[1], device=seq.device).unsqueeze(0)
        keep = (j < accept_lens.unsqueeze(1)) & (rows != j)
        src = table[slot_t, seq.unsqueeze(1) + rows][keep]
        dst = table[slot_t, seq.unsqueeze(1) + j][keep]
        if src.numel():
            pool = self.target.pool
            flat = pool.buffer.view(pool.num_layers, 2, -1, pool.num_kv_heads, pool.head_dim)
            flat[:, :, dst] = flat[:, :, src].clone()  # clone: sources and targets may overlap

    def _draft_extend(self, reqs: list[Req], slots: list[int], seq_lens: list[int], rows: torch.Tensor,
                      vr: VerifyResult, feats: torch.Tensor) -> None:
        """Head over [L, L + ntok): row j pairs the target's feature at accepted row j with the
        token that followed it; rows past the accepted length only scribble beyond seq_len."""
        bs, ntok = rows.shape
        emitted = torch.where(vr.emitted >= 0, vr.emitted, vr.bonus.unsqueeze(1))
        if emitted.shape[1] < ntok:
            emitted = torch.cat((emitted, vr.bonus.unsqueeze(1).expand(bs, ntok - emitted.shape[1])), 1)
        flat_rows = (rows + torch.arange(bs, device=rows.device).unsqueeze(1) * ntok).reshape(-1)
        ctx = self.draft.make_context(ForwardMode.DRAFT_EXTEND, slots, seq_lens, [ntok] * bs)
        g = self.draft.forward(emitted[:, :ntok].reshape(-1), ctx, features=feats[flat_rows])
        last = torch.arange(bs, device=rows.device) * ntok + vr.accept_lens - 1
        g_last = g[last]
        p, idx = draft_topk(self.draft.model, g_last, self.cfg.eagle_topk)
        for i, req in enumerate(reqs):
            req.spec_state = EagleReqState(p[i], idx[i], g_last[i])
