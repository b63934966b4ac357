"""The EAGLE worker: an Executor that drafts, verifies with the target, and draft-extends.

Prefill (EXTEND): the target runs the prompt chunk; the head runs over the same positions
with tokens shifted left by one (the last one is the next prompt token, or the sampled bonus
when the chunk ends the prompt), writing draft KV at the target's slots. A finished prompt
publishes its length and stashes its bonus token, top-k and draft hidden state in the FutureMap
row of its slot: exactly what a PD decode node seeds from the handoff.

Decode: resolve lengths and draft input from the batch's FutureMap rows -> draft a tree ->
TARGET_VERIFY over W rows -> accept (spec.verify) -> `on_publish` the new lengths -> move the
accepted rows' target KV to the front of the window (trees only) -> draft-extend over a
constant-width window (accepted rows first) -> stash the head's state at the last accepted row.
`seq_len` grows by accept_len = correct drafts + 1; the new bonus token has no KV. Between
iterations nothing but the slot index ties a request to its state, so the overlap scheduler can
launch the next decode before the host has seen this one's results.

Widths come from the algorithm: W = get_num_tokens_per_req_for_target_verify(ntok, False) rows
per verify (a chain drafts W - 1 tokens; a tree keeps the W - 1 best candidates) and the
draft-extend window is get_num_tokens_per_req_for_target_verify(ntok, True) rows, run in
TARGET_VERIFY shape when the algorithm `supports_target_verify_for_draft()`, else DRAFT_EXTEND.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core import Batch, ForwardMode, Req, StepOutput
from engine.engine import EngineParts
from engine.executor import (HostCopy, build_input_ids, last_token_rows, maybe_enable_cuda_graphs,
                             sample_positions, sample_tokens, sampled_output, sampling_reqs,
                             scatter_to_batch, seed_prebuilt_rows)
from engine.future_map import BatchRelay, DraftInput, FutureMap, RelayPayload
from engine.h2d import to_device
from engine.handoff import HandoffCodec
from engine.kv_cache import KVPool
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.spec_stats import SpecStats
from spec.accept import accepted_rows, emit_device, host_output, verify_window
from spec.config import MAX_WINDOW, SpecConfig, SpecConfigError
from spec.draft_input import EagleDraftInput, EagleReqState, EagleVerifyInput
from spec.eagle_draft import build_draft_tree, draft_topk
from spec.eagle_handoff import EagleHandoffCodec
from spec.verify import VerifyResult
from spec.windows import emitted_window, last_accepted_rows, shifted_tokens

if TYPE_CHECKING:
    from spec.registry import SpeculativeAlgorithm


@dataclass
class EaglePending:
    batch: Batch
    copy: HostCopy | None  # None: no request sampled (non-final prefill chunks only)


@dataclass(frozen=True)
class Widths:
    """Rows per request of the verify window and of the draft's fixed-width window."""

    verify: int
    draft: int
    draft_mode: ForwardMode  # DRAFT_EXTEND, or TARGET_VERIFY when the algorithm allows it
    drafts: int  # drafts along the longest path a verify can accept


def resolve_widths(algorithm: "SpeculativeAlgorithm", cfg: SpecConfig) -> Widths:
    """Ask the algorithm for its widths and check that the drafting can fill them."""
    w = algorithm.get_num_tokens_per_req_for_target_verify(cfg.ntok, False)
    wd = algorithm.get_num_tokens_per_req_for_target_verify(cfg.ntok, True)
    name = algorithm.name
    if not 2 <= w <= MAX_WINDOW or not 1 <= wd <= MAX_WINDOW:
        raise SpecConfigError(f"{name}: verify width {w} / draft width {wd} must be in [2, {MAX_WINDOW}]")
    k, steps = cfg.eagle_topk, cfg.num_steps
    if k == 1:
        drafts = w - 1  # a chain drafts as many tokens as the window holds
    else:
        nodes = k + (steps - 1) * k * k
        if w - 1 > nodes:
            raise SpecConfigError(f"{name}: a verify window of {w} rows needs {w - 1} drafted nodes; "
                                  f"{steps} steps of top-{k} draft {nodes}")
        drafts = min(steps, w - 1)
    if wd < drafts + 1:
        raise SpecConfigError(f"{name}: the draft-extend window ({wd} rows) must hold the longest "
                              f"accepted path ({drafts + 1} rows)")
    mode = ForwardMode.TARGET_VERIFY if algorithm.supports_target_verify_for_draft() else ForwardMode.DRAFT_EXTEND
    return Widths(w, wd, mode, drafts)


class EagleWorker:
    def __init__(self, target: ModelRunner, draft: ModelRunner, sampler: Sampler, config: SpecConfig,
                 aux_layers: tuple[int, ...], widths: Widths) -> None:
        self.target, self.draft, self.sampler = target, draft, sampler
        self.cfg = config
        self.aux_layers = aux_layers  # EAGLE-3: target layers whose inputs feed the head
        self.widths = widths
        self.stats = SpecStats(max_drafts=widths.drafts)
        self._future_map: FutureMap | None = None

    @classmethod
    def create(cls, parts: EngineParts, config: SpecConfig, fmt: str,
               algorithm: "SpeculativeAlgorithm") -> "EagleWorker":
        from engine.draft_loader import load_draft_model

        assert config.draft_model_path is not None
        widths = resolve_widths(algorithm, config)  # before the (slow) head load
        head, hcfg, aux = load_draft_model(config.draft_model_path, fmt, parts.runner.model,
                                           parts.model_config, parts.dtype, parts.device)
        pool = KVPool(hcfg.num_layers, parts.kv.allocator.num_pages, parts.kv.page_size,
                      hcfg.num_kv_heads, hcfg.head_dim, parts.dtype, parts.device)
        why = True if algorithm.supports_target_verify_for_draft() else (
            f"{algorithm.name}.supports_target_verify_for_draft() is False")
        draft = ModelRunner(head, parts.kv, pool, parts.runner.attn_backend, parts.device, target_verify=why)
        maybe_enable_cuda_graphs(draft, parts.config.cuda_graph_max_bs, parts.config.cuda_graph_padded_eager)
        return cls(parts.runner, draft, parts.sampler, config, aux, widths)

    # ---- Executor protocol ----
    def bind_future_map(self, future_map: FutureMap) -> None:
        self._future_map = future_map

    @property
    def future_map(self) -> FutureMap:
        if self._future_map is None:
            raise RuntimeError("no FutureMap bound: the scheduler binds one at start-up")
        return self._future_map

    def kv_tokens_per_decode(self) -> int:
        w = self.widths
        return max(w.verify, w.draft, self._draft_steps() * self.cfg.eagle_topk)

    def supports_overlap(self) -> bool:
        return True

    def _draft_steps(self) -> int:
        """Drafting depth: a chain fills the verify window; a tree drafts num_steps levels."""
        return self.widths.drafts if self.cfg.eagle_topk == 1 else self.cfg.num_steps

    def capture_cuda_graphs(self) -> None:
        """Verify, draft-step and draft-extend graphs for every captured batch size, at start-up.
        Shapes follow the drafting: step s of a tree sees a mask over s * topk scratch slots."""
        k, w = self.cfg.eagle_topk, self.widths
        tree = k > 1
        self.target.capture(ForwardMode.TARGET_VERIFY, w.verify, tree_width=w.verify if tree else None,
                            aux_hidden_layers=self.aux_layers)
        dev, dtype = self.target.device, self.draft.pool.buffer.dtype
        target_h = self.target.model.config.hidden_size
        feat_width = target_h * len(self.aux_layers) if self.aux_layers else target_h
        self.draft.capture(w.draft_mode, w.draft, features=torch.empty(0, feat_width, dtype=dtype, device=dev))
        draft_feats = torch.empty(0, self.draft.model.config.hidden_size, dtype=dtype, device=dev)
        for step in range(1, self._draft_steps()):
            self.draft.capture(ForwardMode.DECODE, k, tree_width=step * k if tree else None,
                               features=draft_feats)

    def on_admit(self, req: Req) -> None:
        self.sampler.on_admit(req)

    def adopt_prebuilt(self, reqs: list[Req], draft_input: DraftInput, relay: BatchRelay) -> None:
        seed_prebuilt_rows(reqs, draft_input, relay)

    def on_release(self, req: Req) -> None:
        req.spec_state = None

    def extra_kv_pools(self) -> list[KVPool]:
        """PD: the draft KV moves with the target's, by the same page ids."""
        return [self.draft.pool]

    def handoff_codec(self) -> HandoffCodec:
        """PD: the draft's top-k and hidden state travel in the handoff row."""
        return EagleHandoffCodec(self.cfg.eagle_topk, self.draft.model.config.hidden_size,
                                 self.draft.pool.buffer.dtype)

    def spec_stats(self) -> SpecStats:
        return self.stats

    def adaptive_snapshot(self) -> dict[str, Any] | None:
        return None

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
        return host_output(self.stats, pending.copy.wait())

    # ---- prefill ----
    def _features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(aux, dim=-1) if self.aux_layers else hidden

    def _prefill(self, batch: Batch, relay: BatchRelay) -> EaglePending:
        reqs, lens, prefix = batch.reqs, batch.extend_lens, batch.prefix_lens
        dev = self.target.device
        slots = [r.slot for r in reqs]
        ctx = self.target.make_context(ForwardMode.EXTEND, slots, prefix, lens,
                                       aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.forward(build_input_ids(batch, dev), ctx)
        feats = self._features(hidden, aux)
        sampling = sampling_reqs(batch)
        rows = last_token_rows(batch, dev)
        shifted = to_device(shifted_tokens(batch), dev)  # draft-extend input: shifted left by one
        out, done = None, relay.select(batch.sample)
        if sampling:
            out = sample_tokens(self.sampler, self.target.logits(hidden[rows]), sampling,
                                sample_positions(batch))
            shifted[rows] = out["tokens"]  # the tail of a finished prompt is its sampled bonus
            ends = [p + n for p, n, s in zip(prefix, lens, batch.sample) if s]
            # fence before draft-extend: the next decode's lengths do not wait for the head
            done.on_publish(to_device(ends, dev))
        dctx = self.draft.make_context(ForwardMode.DRAFT_EXTEND, slots, prefix, lens)
        g = self.draft.forward(shifted, dctx, features=feats)
        if out is None:
            return EaglePending(batch, None)
        g_last = g[rows]
        p, topk_idx = draft_topk(self.draft.model, g_last, self.cfg.eagle_topk)
        done.stash(RelayPayload(out["tokens"], p, topk_idx, g_last))
        _keep_handoff(sampling, p, topk_idx, g_last)
        return EaglePending(batch, HostCopy(out))

    # ---- decode ----
    def _decode(self, batch: Batch, relay: BatchRelay) -> EaglePending:
        reqs = batch.reqs
        bs, w = len(reqs), self.widths.verify
        slots, bound = [r.slot for r in reqs], batch.prefix_lens
        seq = relay.resolve_seq_lens()  # exact lengths, on the device only
        r = relay.resolve()
        di = EagleDraftInput(r.topk_p, r.topk_index, r.hidden_states, r.bonus_tokens,
                             future_indices=relay.indices)
        tree = build_draft_tree(self.draft, di, slots, seq, bound, self._draft_steps(),
                                self.cfg.eagle_topk, w)
        vi = EagleVerifyInput.from_tree(tree, seq)
        ctx = self.target.make_context(ForwardMode.TARGET_VERIFY, slots, bound, [w] * bs,
                                       device_prefix=seq, positions=vi.positions,
                                       tree_mask=vi.tree_mask, aux_hidden_layers=self.aux_layers)
        hidden, aux = self.target.forward(tree.tokens.reshape(-1), ctx)
        logits = self.target.logits(hidden)
        vr = verify_window(self.sampler, reqs, tree, logits, seq)
        relay.on_publish(seq + vr.accept_lens)  # between verify and draft-extend
        rows = accepted_rows(vr, w)  # (bs, W) window rows, accepted first
        if not tree.is_chain:
            self._compact_target_kv(slots, seq, rows, vr.accept_lens)
        self._draft_extend(slots, seq, bound, vr, self._features(hidden, aux), relay)
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

    def _draft_extend(self, slots: list[int], seq: torch.Tensor, bound: list[int], vr: VerifyResult,
                      feats: torch.Tensor, relay: BatchRelay) -> None:
        """Head over [L, L + Wd): row j pairs the target's feature at accepted row j with the
        token that followed it; rows past the accepted length only scribble beyond seq_len."""
        bs, w, wd = len(slots), self.widths.verify, self.widths.draft
        rows = accepted_rows(vr, wd)
        flat_rows = (rows + torch.arange(bs, device=rows.device).unsqueeze(1) * w).reshape(-1)
        ctx = self.draft.make_context(self.widths.draft_mode, slots, bound, [wd] * bs, device_prefix=seq)
        g = self.draft.forward(emitted_window(vr, wd).reshape(-1), ctx, features=feats[flat_rows])
        g_last = g[last_accepted_rows(vr, wd)]
        p, topk_idx = draft_topk(self.draft.model, g_last, self.cfg.eagle_topk)
        relay.stash(RelayPayload(vr.bonus, p, topk_idx, g_last))


def _keep_handoff(reqs: list[Req], p: torch.Tensor, idx: torch.Tensor, g: torch.Tensor) -> None:
    """PD prefill: a request that leaves this node (hold_kv) carries its draft state in the
    handoff row (EagleHandoffCodec encodes it); everyone else keeps only its FutureMap row."""
    for i, req in enumerate(reqs):
        if req.hold_kv:
            req.spec_state = EagleReqState(p[i], idx[i], g[i])


__all__ = ["EaglePending", "EagleWorker", "Widths", "resolve_widths"]
