"""N-gram prompt-lookup speculative decoding, shipped as a plugin (entry point `NGRAM`).

No draft model: the drafts of a request come from its own prompt + output. The longest suffix
of length n in [ngram_max .. ngram_min] that occurred earlier is looked up (most recent earlier
occurrence wins) and the tokens that followed it are proposed. They form a chain
[bonus, d1 .. d_k] that the target checks in one TARGET_VERIFY forward; spec.rejection accepts
them exactly as it accepts EAGLE's chain drafts, so greedy output equals plain greedy output
and sampled output keeps the target's distribution.

The algorithm registers through the `pdserve.speculative` entry point (see pyproject.toml), not
at import, so it exercises the same discovery path as an out-of-tree plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from engine.core import Batch, DecodePlan, ForwardMode, Req, StepOutput
from engine.future_map import BatchRelay, FutureMap
from engine.spec_stats import SpecStats
from engine.worker import PlainExecutor, WorkerBase
from spec.jump_forward import forced_drafts
from spec.verify_step import step_output, verify_window
from spec.config import MAX_WINDOW, SpecConfig, SpecConfigError
from spec.draft_input import BonusDraftInput, bonus_draft_input
from spec.registry import CustomSpecAlgo
from spec.tree import chain_tree

if TYPE_CHECKING:
    from engine.algorithm import EngineParts
    from engine.model_runner import ModelRunner
    from engine.sampler import Sampler

# Tokens of prompt + output searched per request and step: bounds the lookup's host cost
# (one C-level scan plus a few comparisons per candidate) however long the context grows.
LOOKUP_WINDOW = 1024


def propose_drafts(context: Sequence[int], num_drafts: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to `num_drafts` tokens following the most recent earlier occurrence of the longest
    suffix of `context` whose length is in [ngram_min, ngram_max]; [] when none occurred.

    Continuations that run past the end of `context` keep copying from the drafts themselves,
    which extends a periodic pattern (e.g. "a b a b") instead of stopping short.
    """
    n = len(context)
    if num_drafts <= 0 or n <= ngram_min:
        return []
    rev = list(reversed(context))  # rev[0] is the newest token: candidates are found by list.index
    best_len, best_at = 0, -1
    start = 1
    while best_len < ngram_max:
        try:
            j = rev.index(rev[0], start)  # an earlier copy of the newest token ends a candidate
        except ValueError:
            break
        start = j + 1
        limit = min(ngram_max, n - j)
        m = 1
        while m < limit and rev[j + m] == rev[m]:
            m += 1
        if m > best_len:  # strictly longer: on ties the more recent (found first) wins
            best_len, best_at = m, j
    if best_len < ngram_min:
        return []
    follow = n - best_at  # forward index of the token after the matched occurrence (< n)
    drafts: list[int] = []
    for t in range(num_drafts):
        src = follow + t
        drafts.append(context[src] if src < n else drafts[src - n])
    return drafts


def _chain_config(config: SpecConfig) -> SpecConfig:
    cfg = config.resolved()
    if cfg.eagle_topk != 1:
        raise SpecConfigError(
            f"--speculative-eagle-topk must be 1 for {cfg.algorithm} (n-gram drafts form a chain), got {cfg.eagle_topk}"
        )
    return cfg


class NgramWorker(WorkerBase):
    """Executor: plain prefill; decode = prompt lookup -> chain TARGET_VERIFY over W rows -> accept.
    W comes from the algorithm's verify-width hook: the lookup proposes W - 1 drafts."""

    def __init__(self, target: ModelRunner, sampler: Sampler, config: SpecConfig, width: int) -> None:
        super().__init__(target, sampler)
        self.cfg = _chain_config(config)
        if not 2 <= width <= MAX_WINDOW:
            raise SpecConfigError(f"n-gram verify width must be in [2, {MAX_WINDOW}], got {width}")
        self.width = width
        self.plain = PlainExecutor(target, sampler)  # prefill is exactly the non-speculative one
        self.stats = SpecStats(max_drafts=width - 1)

    @property
    def target(self) -> ModelRunner:
        return self.runner

    # ---- Executor hooks ----
    def bind_future_map(self, future_map: FutureMap) -> None:
        super().bind_future_map(future_map)
        self.plain.bind_future_map(future_map)

    def kv_tokens_per_decode(self) -> int:
        return self.width

    def activate_step_by_batch(self, batch_size: int) -> int:
        return self.width - 1

    def plan_decode(self, batch_size: int, room: int) -> DecodePlan:
        """The whole window, narrower near the context limit (down to the bonus token alone)."""
        width = max(1, min(self.activate_step_by_batch(batch_size) + 1, room))
        return DecodePlan(width, width - 1)

    def supports_overlap(self) -> bool:
        """No: the drafts are looked up in the host's copy of each request's tokens, so the
        previous step's tokens must have reached the host before the next step can start."""
        return False

    def capture_cuda_graphs(self) -> None:
        self.target.capture(ForwardMode.TARGET_VERIFY, self.width)
        self.target.capture_prompts(ForwardMode.EXTEND)
        self.target.freeze_graphs()

    def spec_stats(self) -> SpecStats:
        return self.stats

    @torch.inference_mode()
    def step(self, batch: Batch, relay: BatchRelay) -> StepOutput:
        if batch.mode is ForwardMode.EXTEND:
            return self.plain.step(batch, relay)
        return self._decode(batch)

    def launch(self, batch: Batch, relay: BatchRelay) -> StepOutput:
        return self.step(batch, relay)  # synchronous: the scheduler never overlaps this executor

    def collect(self, handle: StepOutput) -> StepOutput:
        return handle

    # ---- decode ----
    def draft_window(self, req: Req, width: int) -> list[int]:
        """[bonus, d1 .. d_k] for one decoding request, padded to `width` (padding is just rejected).
        A constrained request drafts what its grammar forces first, then looks up what follows."""
        k = width - 1
        end = req.total_len
        context = req.tokens(max(0, end - LOOKUP_WINDOW), end)  # ends with the bonus token
        forced = forced_drafts(req, k)
        drafts = forced + propose_drafts(context + forced, k - len(forced), self.cfg.ngram_min, self.cfg.ngram_max)
        pad = drafts[-1] if drafts else context[-1]
        return [context[-1], *drafts, *([pad] * (k - len(drafts)))]

    def _decode(self, batch: Batch) -> StepOutput:
        reqs, ntok = batch.reqs, batch.window  # the width it was planned with
        bs, dev = len(reqs), self.target.device
        slots, seq_lens = [r.slot for r in reqs], batch.prefix_lens  # exact: never overlapped
        tokens = torch.tensor([self.draft_window(r, ntok) for r in reqs], dtype=torch.int64, device=dev)
        tree = chain_tree(tokens)
        # a chain is causal in row order at positions seq_len + row: no tree mask, no KV compaction
        ctx = self.target.make_context(ForwardMode.TARGET_VERIFY, slots, seq_lens, [ntok] * bs)
        hidden, _ = self.target.forward(tokens.reshape(-1), ctx)
        logits = self.target.logits(hidden)
        seq = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
        vr = verify_window(self.sampler, reqs, tree, logits, seq)
        rows = torch.arange(ntok, device=dev).expand(bs, ntok)  # a chain's path is its row order
        return step_output(self.sampler, self.stats, reqs, vr, logits, rows, drafts=ntok - 1)


class NgramAlgo(CustomSpecAlgo):
    """N-gram prompt lookup: no draft model, no draft KV, nothing but the bonus token to relay."""

    @property
    def _label(self) -> str:
        return self.name or type(self).__name__  # `name` is set when the algorithm is registered

    def is_ngram(self) -> bool:
        return True

    def needs_draft_model(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def build_disagg_draft_input(
        self, batch: Batch, config: SpecConfig, last_tokens: Any, future_map: FutureMap | None
    ) -> BonusDraftInput:
        """PD decode: the drafts come from the context the decode node already has, so the
        prefill node's handoff reduces to the bonus token; validate before touching any req."""
        _chain_config(config)
        return bonus_draft_input(batch, last_tokens, future_map, self._label)

    def create_worker(self, parts: EngineParts, config: SpecConfig) -> NgramWorker:
        cfg = _chain_config(config)
        width = self.get_num_tokens_per_req_for_target_verify(cfg.ntok, False)
        return NgramWorker(parts.runner, parts.sampler, cfg, width)


__all__ = ["LOOKUP_WINDOW", "NgramAlgo", "NgramWorker", "propose_drafts"]
