"""The EAGLE worker: an Executor that drafts, verifies with the target, and draft-extends.

Prefill (EXTEND): the target runs the prompt chunk; the head runs over the same positions
with tokens shifted left by one (the last one is the next prompt token, or the sampled bonus
when the chunk ends the prompt), writing draft KV at the target's slots. A finished prompt
publishes its length and stashes its bonus token, top-k and draft hidden state in the FutureMap
row of its slot: exactly what a PD decode node seeds from the handoff.

Decode: resolve lengths and draft input from the FutureMap -> draft a tree -> TARGET_VERIFY over
`ntok` rows -> accept (spec.verify) -> publish the new lengths -> move the accepted rows' target
KV to the front of the window (trees only) -> draft-extend over a constant-width window (accepted
rows first) -> stash the head's state at the last accepted row. `seq_len` grows by accept_len =
correct drafts + 1; the new bonus token has no KV. Between iterations nothing but the slot index
ties a request to its state, so the overlap scheduler can launch the next decode before the host
has seen this one's results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core import Batch, ForwardMode, Req, StepOutput
from engine.engine import EngineParts
from engine.executor import (HostCopy, build_input_ids, last_token_rows, maybe_enable_cuda_graphs,
                             sample_positions, sample_tokens, sampled_output, sampling_reqs,
                             scatter_to_batch)
from engine.h2d import to_device
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from spec.accept import accepted_rows, emit_device, host_output, verify_window
from spec.config import SpecConfig
from spec.draft_input import EagleDraftInput, EagleReqState, EagleVerifyInput
from spec.eagle_draft import build_draft_tree, draft_topk
from spec.future_map import FutureMap, RelayPayload
from spec.metrics import SpecStats
from spec.verify import VerifyResult

if TYPE_CHECKING:
    from spec.registry import SpeculativeAlgorithm


@dataclass
class EaglePending:
    batch: Batch
    copy: HostCopy | None  # None: no request sampled (non-final prefill chunks only)


class EagleWorker:
    def __init__(self, target: ModelRunner, draft: ModelRunner, sampler: Sampler, config: SpecConfig,
                 aux_layers: tuple[int, ...], future_map: FutureMap) -> None:
        self.target, self.draft, self.sampler = target, draft, sampler
        self.cfg = config
        self.aux_layers = aux_layers  # EAGLE-3: target layers whose inputs feed the head
        self.future_map = future_map  # per-slot relay of lengths, bonus tokens, top-k, hidden
        self.stats = SpecStats(max_drafts=config.num_steps)
        # tokens per request of the target's verify and the draft's extend graphs (see create)
        self.graph_widths = (config.ntok, config.ntok)

    @classmethod
    def create(cls, parts: EngineParts, config: SpecConfig, fmt: str,
               algorithm: "SpeculativeAlgorithm") -> "EagleWorker":
        from engine.draft_loader import load_draft_model

        assert config.draft_model_path is not None
        head, hcfg, aux = load_draft_model(config.draft_model_path, fmt, parts.runner.model,
                                           parts.model_config, parts.dtype, parts.device)
        pool = KVPool(hcfg.num_layers, parts.kv.allocator.num_pages, parts.kv.page_size,
                      hcfg.num_kv_heads, hcfg.head_dim, parts.dtype, parts.device)
        draft = ModelRunner(head, parts.kv, pool, parts.runner.attn_backend, parts.device)
        maybe_enable_cuda_graphs(draft, getattr(parts.config, "cuda_graph_max_bs", 0))
        fm = algorithm.create_future_map(parts.kv.req_to_token.shape[0], parts.device,
                                         debug=getattr(parts.config, "future_map_debug", False))
        worker = cls(parts.runner, draft, parts.sampler, config, aux, fm)
        # the algorithm fixes the verify window (and so the graphs' width) for target and draft
        worker.graph_widths = (algorithm.get_num_tokens_per_req_for_target_verify(config.ntok, False),
                               algorithm.get_num_tokens_per_req_for_target_verify(config.ntok, True))
        if worker.graph_widths != (config.ntok, config.ntok):
            raise ValueError(f"{algorithm.name}: verify windows of {worker.graph_widths} tokens per "
                             f"request; the EAGLE worker verifies {config.ntok}")
        return worker

    # ---- Executor protocol ----
    def kv_tokens_per_decode(self) -> int:
        return max(self.cfg.ntok, self.cfg.num_steps * self.cfg.eagle_topk)

    def supports_overlap(self) -> bool:
        return True

    def capture_cuda_graphs(self) -> None:
        """Verify, draft-step and draft-extend graphs for every captured batch size, at start-up.
        Shapes follow the drafting: step s of a tree sees a mask over s * topk scratch slots."""
        cfg, k = self.cfg, self.cfg.eagle_topk
        ntok, extend_ntok = self.graph_widths
        tree = k > 1
        self.target.capture(ForwardMode.TARGET_VERIFY, ntok, tree_width=ntok if tree else None,
                            aux_hidden_layers=self.aux_layers)
        dev, dtype = self.target.device, self.draft.pool.buffer.dtype
        target_h = self.target.model.config.hidden_size
        feat_width = target_h * len(self.aux_layers) if self.aux_layers else target_h
        self.draft.capture(ForwardMode.DRAFT_EXTEND, extend_ntok,
                           features=torch.empty(0, feat_width, dtype=dtype, device=dev))
        draft_feats = torch.empty(0, self.draft.model.config.hidden_size, dtype=dtype, device=dev)
        for step in range(1, cfg.num_steps):
            self.draft.capture(ForwardMode.DECODE, k, tree_width=step * k if tree else None,
                               features=draft_feats)

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
        self.future_map.invalidate(torch.tensor([req.slot], dtype=torch.int64))

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput:
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: Batch) -> EaglePending:
        if batch.mode is ForwardMode.EXTEND:
            return self._prefill(batch)
        return self._decode(batch)

    def collect(self, pending: EaglePending) -> StepOutput:
        batch = pending.batch
        if pending.copy is None:
            return StepOutput(tokens=[[] for _ in batch.reqs])
        if batch.mode is ForwardMode.EXTEND:
            return scatter_to_batch(sampled_output(pending.copy.wait()), batch.sample)
        return host_output(self.stats, pending.copy.wait())

    # ---- prefill ----
    def _features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(aux, dim=-1) if self.aux_layers else hidden

    def _prefill(self, batch: Batch) -> EaglePending:
        reqs, lens, prefix = batch.reqs, batch.extend_lens, batch.prefix_lens
        dev = self.target.device
        slots = [r.slot for r in reqs]
        ctx = self.target.make_context(ForwardMode.EXTEND, slots, prefix, lens,
                                       aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.forward(build_input_ids(batch, dev), ctx)
        feats = self._features(hidden, aux)
        sampling = sampling_reqs(batch)
        rows = last_token_rows(batch, dev)
        shifted = to_device(_shifted_tokens(batch), dev)  # draft-extend input: shifted left by one
        out, idx = None, None
        if sampling:
            out = sample_tokens(self.sampler, self.target.logits(hidden[rows]), sampling,
                                sample_positions(batch))
            shifted[rows] = out["tokens"]  # the tail of a finished prompt is its sampled bonus
            idx = to_device([r.slot for r in sampling], dev)
            ends = [p + n for p, n, s in zip(prefix, lens, batch.sample) if s]
            # fence before draft-extend: the next decode's lengths do not wait for the head
            self.future_map.publish(idx, to_device(ends, dev))
        dctx = self.draft.make_context(ForwardMode.DRAFT_EXTEND, slots, prefix, lens)
        g = self.draft.forward(shifted, dctx, features=feats)
        if out is None:
            return EaglePending(batch, None)
        g_last = g[rows]
        p, topk_idx = draft_topk(self.draft.model, g_last, self.cfg.eagle_topk)
        self.future_map.stash(idx, RelayPayload(out["tokens"], p, topk_idx, g_last))
        _keep_handoff(sampling, p, topk_idx, g_last)
        return EaglePending(batch, HostCopy(out))

    # ---- decode ----
    def _decode(self, batch: Batch) -> EaglePending:
        reqs = batch.reqs
        bs, ntok = len(reqs), self.cfg.ntok
        slots, bound = [r.slot for r in reqs], batch.prefix_lens
        idx = to_device(slots, self.target.device)
        seq = self.future_map.resolve_seq_lens(idx)  # exact lengths, on the device only
        relay = self.future_map.resolve(idx)
        di = EagleDraftInput(relay.topk_p, relay.topk_index, relay.hidden_states, relay.bonus_tokens,
                             future_indices=idx)
        tree = build_draft_tree(self.draft, di, slots, seq, bound, self.cfg.num_steps,
                                self.cfg.eagle_topk, ntok)
        vi = EagleVerifyInput.from_tree(tree, seq)
        ctx = self.target.make_context(ForwardMode.TARGET_VERIFY, slots, bound, [ntok] * bs,
                                       device_prefix=seq, positions=vi.positions,
                                       tree_mask=vi.tree_mask, aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.forward(tree.tokens.reshape(-1), ctx)
        logits = self.target.logits(hidden)
        vr = verify_window(self.sampler, reqs, tree, logits, seq)
        self.future_map.publish(idx, seq + vr.accept_lens)  # between verify and draft-extend
        rows = accepted_rows(vr, ntok)  # (bs, ntok) window rows, accepted first
        if not tree.is_chain:
            self._compact_target_kv(slots, seq, rows, vr.accept_lens)
        self._draft_extend(slots, seq, bound, rows, vr, self._features(hidden, aux), idx)
        return EaglePending(batch, HostCopy(emit_device(self.sampler, reqs, vr, logits, rows)))

    def _compact_target_kv(self, slots: list[int], seq: torch.Tensor, rows: torch.Tensor,
                           accept_lens: torch.Tensor) -> None:
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

    def _draft_extend(self, slots: list[int], seq: torch.Tensor, bound: list[int], rows: torch.Tensor,
                      vr: VerifyResult, feats: torch.Tensor, idx: torch.Tensor) -> None:
        """Head over [L, L + ntok): row j pairs the target's feature at accepted row j with the
        token that followed it; rows past the accepted length only scribble beyond seq_len."""
        bs, ntok = rows.shape
        emitted = torch.where(vr.emitted >= 0, vr.emitted, vr.bonus.unsqueeze(1))
        if emitted.shape[1] < ntok:
            emitted = torch.cat((emitted, vr.bonus.unsqueeze(1).expand(bs, ntok - emitted.shape[1])), 1)
        flat_rows = (rows + torch.arange(bs, device=rows.device).unsqueeze(1) * ntok).reshape(-1)
        ctx = self.draft.make_context(ForwardMode.DRAFT_EXTEND, slots, bound, [ntok] * bs,
                                      device_prefix=seq)
        g = self.draft.forward(emitted[:, :ntok].reshape(-1), ctx, features=feats[flat_rows])
        last = torch.arange(bs, device=rows.device) * ntok + vr.accept_lens - 1
        g_last = g[last]
        p, topk_idx = draft_topk(self.draft.model, g_last, self.cfg.eagle_topk)
        self.future_map.stash(idx, RelayPayload(vr.bonus, p, topk_idx, g_last))


def _shifted_tokens(batch: Batch) -> list[int]:
    """Each window's tokens shifted left by one; the tail is the next prompt token, or a
    placeholder where the window samples (the sampled token is written in on the device)."""
    shifted: list[int] = []
    for req, p, n, s in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample):
        shifted += req.tokens(p + 1, p + n)
        shifted.append(0 if s else req.tokens(p + n, p + n + 1)[0])
    return shifted


def _keep_handoff(reqs: list[Req], p: torch.Tensor, idx: torch.Tensor, g: torch.Tensor) -> None:
    """PD prefill: a request that leaves this node (hold_kv) carries its draft state in the aux
    row, so keep it on the request; everyone else keeps nothing but its FutureMap row."""
    for i, req in enumerate(reqs):
        if req.hold_kv:
            req.spec_state = EagleReqState(p[i], idx[i], g[i])


__all__ = ["EaglePending", "EagleWorker"]
