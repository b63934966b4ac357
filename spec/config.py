"""Speculative decoding settings (the `--speculative-*` flags), validated with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.kv_cache import MAX_DECODE_WINDOW

if TYPE_CHECKING:
    from spec.adaptive import AdaptiveConfig

MAX_TOPK = 16  # the PD aux row carries at most 16 top-k entries
MAX_WINDOW = MAX_DECODE_WINDOW  # tokens one verify may write beyond seq_len


class SpecConfigError(ValueError):
    """A speculative setting that cannot work; the message names the flag."""


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str = "NONE"
    draft_model_path: str | None = None
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int | None = None  # default: num_steps + 1 for a chain, 2x that for a tree
    # n-gram prompt lookup (the bundled plugin)
    ngram_min: int = 1
    ngram_max: int = 4
    # adaptive step counts by batch size (spec/adaptive); the JSON config, or the built-in default
    adaptive: bool = False
    adaptive_config: str | None = None
    # EAGLE's 0-step iterations (adaptive steps chose plain decoding): leave the draft's top-k to
    # the next drafting iteration, which computes it from the stashed hidden state (defer_guess),
    # and let the head catch up over a backlog in bulk instead of running every iteration
    # (batch_catch_up; with defer_guess and whole-iteration graphs). Neither changes outputs or
    # acceptance (tested against both off); serving keeps both on, they are not flags.
    defer_guess: bool = True
    batch_catch_up: bool = True

    def resolved(self) -> "SpecConfig":
        """Fill defaults and check the combination; returns a new config."""
        algo = self.algorithm.upper()
        cfg = replace(self, algorithm=algo)
        if algo == "NONE":
            return cfg
        _need(self.num_steps >= 1, "--speculative-num-steps", f"must be >= 1, got {self.num_steps}")
        _need(
            1 <= self.eagle_topk <= MAX_TOPK,
            "--speculative-eagle-topk",
            f"must be in [1, {MAX_TOPK}], got {self.eagle_topk}",
        )
        chain = self.num_steps + 1
        ntok = self.num_draft_tokens
        if ntok is None:
            ntok = chain if self.eagle_topk == 1 else min(2 * chain, 1 + self.num_steps * self.eagle_topk)
        if self.eagle_topk == 1:
            _need(
                ntok == chain,
                "--speculative-num-draft-tokens",
                f"must equal num_steps + 1 = {chain} when topk is 1, got {ntok}",
            )
        max_nodes = 1 + self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2
        _need(
            2 <= ntok <= max_nodes,
            "--speculative-num-draft-tokens",
            f"must be in [2, {max_nodes}] for {self.num_steps} steps of top-{self.eagle_topk}, got {ntok}",
        )
        _need(
            max(ntok, self.num_steps * self.eagle_topk) <= MAX_WINDOW,
            "--speculative-num-draft-tokens",
            f"the verify window may not exceed {MAX_WINDOW} tokens",
        )
        _need(
            1 <= self.ngram_min <= self.ngram_max,
            "--speculative-ngram-min/--speculative-ngram-max",
            f"need 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}",
        )
        if self.draft_model_path is not None:
            _need(
                Path(self.draft_model_path).is_dir(),
                "--speculative-draft-model-path",
                f"{self.draft_model_path!r} is not a directory",
            )
        self._check_adaptive()
        return replace(cfg, num_draft_tokens=ntok)

    def _check_adaptive(self) -> None:
        _need(
            self.adaptive or self.adaptive_config is None,
            "--speculative-adaptive-config",
            "needs --speculative-adaptive",
        )
        if not self.adaptive:
            return
        _need(
            self.eagle_topk == 1,
            "--speculative-adaptive",
            f"needs --speculative-eagle-topk 1 (chains), got {self.eagle_topk}",
        )
        cfg = self.adaptive_policy_config()
        assert cfg is not None
        try:
            cfg.check_initial_steps(self.num_steps)
        except ValueError as e:
            raise SpecConfigError(f"--speculative-num-steps: {e}") from None
        _need(
            cfg.max_steps() + 1 <= MAX_WINDOW,
            "--speculative-adaptive-config",
            f"candidate steps up to {cfg.max_steps()} exceed the verify window limit {MAX_WINDOW}",
        )

    def adaptive_policy_config(self) -> "AdaptiveConfig | None":
        """The adaptive step config in force (the file's, or the built-in default), or None."""
        if not self.adaptive:
            return None
        from spec.adaptive import AdaptiveConfig, AdaptiveConfigError

        try:
            return AdaptiveConfig.from_json(self.adaptive_config) if self.adaptive_config else AdaptiveConfig.default()
        except AdaptiveConfigError as e:
            raise SpecConfigError(f"--speculative-adaptive-config: {e}") from None

    @property
    def is_chain(self) -> bool:
        return self.eagle_topk == 1

    @property
    def ntok(self) -> int:
        assert self.num_draft_tokens is not None, "call resolved() first"
        return self.num_draft_tokens


def _need(ok: bool, flag: str, msg: str) -> None:
    if not ok:
        raise SpecConfigError(f"{flag} {msg}")
