"""STANDALONE: the algorithm's answers to pdserve's extension points (see the package README)."""

from __future__ import annotations

from typing import Any

from spec.api import Batch, CustomSpecAlgo, EngineParts, FutureMap, SpecConfig, SpecConfigError
from pdserve_standalone.handoff import StandaloneDraftInput, build_draft_input
from pdserve_standalone.worker import StandaloneWorker


class StandaloneAlgo(CustomSpecAlgo):
    def is_standalone(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return False  # a full LM drafts from tokens: nothing but its top-1 travels

    def need_topk(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True  # the catch-up window is a fixed-width verify-shaped forward

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        # num_steps counts draft-LM forwards; the first draft is the relayed top-1, so the chain
        # holds num_steps + 1 drafts and the bonus token: one row more than num_draft_tokens.
        return num_draft_tokens + 1

    def create_future_map(
        self,
        max_running_requests: int,
        chunked_prefill_size: int,
        context_len: int,
        device: Any,
        *,
        debug: bool = False,
    ) -> FutureMap:
        return FutureMap(max_running_requests + 1, device, need_topk=True, need_hidden=False, debug=debug)

    def build_disagg_draft_input(
        self, batch: Batch, config: SpecConfig, last_tokens: Any, future_map: FutureMap | None
    ) -> StandaloneDraftInput:
        return build_draft_input(batch, last_tokens, future_map, self.name)

    def create_worker(self, parts: EngineParts, config: SpecConfig) -> StandaloneWorker:
        cfg = config.resolved()
        if cfg.eagle_topk != 1:
            raise SpecConfigError(f"--speculative-eagle-topk must be 1 for {self.name} (it drafts a chain)")
        return StandaloneWorker.create(parts, cfg, self)
