"""One batch-size range's step count: an EMA of accepted drafts, hysteresis, and rules against flapping."""

from __future__ import annotations

import math
from typing import Sequence

from spec.adaptive.config import (
    DEFAULT_CONFIRM_DECISIONS,
    DEFAULT_EMA_ALPHA,
    DEFAULT_MIN_DWELL,
    DEFAULT_UPDATE_INTERVAL,
    DEFAULT_UPSHIFT_BACKOFF,
    DEFAULT_UPSHIFT_BACKOFF_MAX,
    DEFAULT_WARMUP_BATCHES,
    AdaptiveConfig,
    SlotConfig,
)


SHADOW_UPSHIFT = 0.5  # steps 0 -> 1 when at least this share of first drafts would be accepted
SHADOW_FRESH = 64  # batches after the last shadow report during which steps-0 decisions follow it


class StepSlot:
    """Chooses the step count of one batch-size range from the drafts its requests accept.

    The EMA policy (as SGLang merged it): `ema` tracks the mean number of correct drafts per request
    (the bonus token not counted). A chain of s steps can accept at most s drafts, so an EMA near
    s - 0.5 says the chain is nearly always used up (go deeper), and an EMA at or below the
    previous candidate's p - 0.5 says the last candidate's extra drafts are mostly wasted (go
    shallower). The net effect is close to steps = round(ema) + 1, snapped to a candidate.

    - Each `update` with a non-empty list is one batch. At steps > 0 it moves the EMA by
      `ema_alpha` towards the batch mean. At steps 0 nothing is drafted, so the EMA is frozen. The
      EMA starts at steps - 1, hence -1 at steps 0, as SGLang does (no clamping).
    - Decisions happen only after `warmup_batches` batches, then every `update_interval` batches.
    - At steps 0 a decision probes the next candidate up: acceptance can only be measured by
      drafting. A negative EMA (never measured) is reseeded to target - 1.
    - Unless the draft reports what it would have done (`observe_shadow`, ours): a draft that
      catches up over tokens decoded without it can check its first draft against each of them.
      Those hit rates move the EMA at steps 0 too (it then estimates accepted drafts at one step),
      and while they keep coming (the last one at most SHADOW_FRESH batches old) a steps-0
      decision upshifts only if the EMA > SHADOW_UPSHIFT + up_hysteresis, instead of probing
      blind: traffic whose drafts would fail costs no failed probes.
    - Otherwise it walks down while ema <= drop(p) for the next lower candidate p, where
      drop(p) = (0.5 if p == 0 else p - 0.5) + down_hysteresis; several levels at once if need be.
    - Only if it did not move down: one candidate up if ema > steps - 0.5 + up_hysteresis. An EMA
      equal to a threshold downshifts and does not upshift.
    - ceiling_coeff > 0: a target that is not an upshift is capped at the largest candidate <=
      max(1, ceil(ema * ceiling_coeff)) (never below the smallest candidate); it never blocks an
      upshift.

    Anti-flapping (ours; SGLang's is an unmerged PR, and users see 3<->5 flips several times a
    second): noise in the EMA around a threshold otherwise switches back and forth. At batch size
    1 the EMA is noisy enough to cross a threshold by chance every few dozen batches.

    - Minimum dwell: after a switch at batch t, no decision may switch before batch t + min_dwell
      (decisions stay on the warmup/interval grid, so the next one is the first grid point then).
    - Confirmation: a switch happens only when `confirm_decisions` consecutive decisions (those
      the dwell lets through) want to move the same way (all up or all down); it goes to the
      last one's target. A decision that wants to stay, or the other way, restarts the count, and
      so does a switch. 1 turns this off. It costs (confirm_decisions - 1) * update_interval
      batches of reaction time and filters out one-off excursions of the EMA.
    - Upshifts move one candidate at a time (SGLang walks several), so a failure is cheap and
      each level is judged on its own data.
    - Failed upshift: an upshift from level a at batch t is FAILED if a downshift happens at batch
      n <= t + W, with W = min_dwell + 4 * confirm_decisions * update_interval (the dwell, then
      room for four confirmed decisions); that downshift necessarily lands at <= a. Upshifts from
      level a are then blocked until batch n + B, where B = upshift_backoff * 2**(k - 1) capped at
      upshift_backoff_max, k being the consecutive failures from level a. An upshift still
      standing after its window, or followed by a further upshift, is SUCCESSFUL and resets k for
      its level. The backoff never blocks downshifts, nor upshifts from other levels.
      upshift_backoff = 0 turns it off.

    Everything is counted in this slot's batches, so the policy is deterministic for a given
    sequence of updates and does not depend on time or on other slots.
    """

    def __init__(
        self,
        cfg: SlotConfig,
        *,
        ema_alpha: float = DEFAULT_EMA_ALPHA,
        warmup_batches: int = DEFAULT_WARMUP_BATCHES,
        update_interval: int = DEFAULT_UPDATE_INTERVAL,
        min_dwell: int = DEFAULT_MIN_DWELL,
        upshift_backoff: int = DEFAULT_UPSHIFT_BACKOFF,
        upshift_backoff_max: int = DEFAULT_UPSHIFT_BACKOFF_MAX,
        confirm_decisions: int = DEFAULT_CONFIRM_DECISIONS,
        initial_steps: int | None = None,
    ) -> None:
        # Validate the settings with the config's own rules and messages.
        AdaptiveConfig(
            ((1, cfg),),
            ema_alpha=ema_alpha,
            warmup_batches=warmup_batches,
            update_interval=update_interval,
            min_dwell=min_dwell,
            upshift_backoff=upshift_backoff,
            upshift_backoff_max=upshift_backoff_max,
            confirm_decisions=confirm_decisions,
        )
        self.cfg = cfg
        self._cands = cfg.candidate_steps
        self._alpha = float(ema_alpha)
        self._warmup = warmup_batches
        self._interval = update_interval
        self._min_dwell = min_dwell
        self._backoff = upshift_backoff
        self._backoff_max = upshift_backoff_max
        self._confirm = confirm_decisions
        # How long an upshift stays on probation: the dwell, then four confirmed decisions. Long
        # enough to catch an EMA that hovers around a threshold over tens of batches.
        self._window = min_dwell + 4 * confirm_decisions * update_interval
        self._steps = _closest(self._cands, initial_steps)
        self._ema = float(self._steps - 1)
        self._batches = 0
        self._switches = 0
        self._failed_upshifts = 0
        self._last_switch: int | None = None  # batch count at the last switch
        self._lean = (0, 0)  # (direction, consecutive decisions wanting it) towards a switch
        self._pending_up: tuple[int, int] | None = None  # (from level, batch) of an upshift on probation
        self._failures: dict[int, int] = {}  # level -> consecutive failed upshifts from it
        self._blocked_until: dict[int, int] = {}  # level -> first batch an upshift from it may happen
        self._shadow_at: int | None = None  # batch count at the last shadow report
        self._shadow_reports = 0

    @classmethod
    def from_config(cls, config: AdaptiveConfig, slot: SlotConfig, initial_steps: int | None) -> StepSlot:
        return cls(
            slot,
            ema_alpha=config.ema_alpha,
            warmup_batches=config.warmup_batches,
            update_interval=config.update_interval,
            min_dwell=config.min_dwell,
            upshift_backoff=config.upshift_backoff,
            upshift_backoff_max=config.upshift_backoff_max,
            confirm_decisions=config.confirm_decisions,
            initial_steps=initial_steps,
        )

    @property
    def current_steps(self) -> int:
        return self._steps

    @property
    def ema(self) -> float:
        return self._ema

    @property
    def switches(self) -> int:
        return self._switches

    @property
    def batches(self) -> int:
        return self._batches

    @property
    def shadow_reports(self) -> int:
        return self._shadow_reports

    @property
    def failed_upshifts(self) -> int:
        return self._failed_upshifts

    def upshift_blocked_until(self, level: int) -> int:
        """The first batch count at which an upshift from `level` may happen (0: never blocked)."""
        return self._blocked_until.get(level, 0)

    def observe_shadow(self, first_draft_hits: Sequence[float]) -> None:
        """At steps 0: per request, the share of first drafts the draft would have had accepted
        over tokens decoded without it. Moves the EMA; not a batch, and never switches by itself."""
        n = len(first_draft_hits)
        if self._steps != 0 or n == 0:
            return
        mean = float(sum(first_draft_hits)) / n
        self._ema = mean if self._ema < 0 else (1.0 - self._alpha) * self._ema + self._alpha * mean
        self._shadow_at = self._batches
        self._shadow_reports += 1

    def update(self, accepted_drafts: Sequence[int]) -> bool:
        """Feed one batch's correct drafts per request (a list of ints; pass `tensor.tolist()`,
        not a tensor); True if the step count changed."""
        n = len(accepted_drafts)
        if n == 0:  # nothing ran in this slot: no evidence, and not a batch
            return False
        if self._steps > 0:
            # (1 - a) * ema + a * x rather than ema + a * (x - ema): exact for a == 1.
            mean = float(sum(accepted_drafts)) / n  # float(): a tensor sum would leak into the EMA
            self._ema = (1.0 - self._alpha) * self._ema + self._alpha * mean
        self._batches += 1
        if self._pending_up is not None and self._batches - self._pending_up[1] > self._window:
            self._judge_upshift(failed=False)
        if not self._decision_due():
            return False
        target = self._target()
        direction = (target > self._steps) - (target < self._steps)
        votes = self._lean[1] + 1 if direction and direction == self._lean[0] else 1
        self._lean = (direction, votes)
        if direction == 0 or votes < self._confirm:
            return False
        self._switch(target)
        return True

    def _decision_due(self) -> bool:
        since = self._batches - self._warmup
        if since <= 0 or since % self._interval:
            return False
        return self._last_switch is None or self._batches - self._last_switch >= self._min_dwell

    def _target(self) -> int:
        cands, steps = self._cands, self._steps
        i = cands.index(steps)
        if steps == 0:
            probe = i + 1 < len(cands) and self._may_upshift(0)
            if probe and self._shadow_at is not None and self._batches - self._shadow_at <= SHADOW_FRESH:
                probe = self._ema > SHADOW_UPSHIFT + self.cfg.up_hysteresis
            return cands[i + 1] if probe else 0
        j = i
        while j > 0 and self._ema <= self._drop_threshold(cands[j - 1]):
            j -= 1
        if (
            j == i
            and i + 1 < len(cands)
            and self._ema > steps - 0.5 + self.cfg.up_hysteresis
            and self._may_upshift(steps)
        ):
            return cands[i + 1]  # one candidate at a time; never capped by the ceiling
        return self._capped(cands[j])

    def _drop_threshold(self, lower: int) -> float:
        # Dropping to plain decoding has its own base: at steps 1 the EMA is a hit rate in [0, 1].
        return (0.5 if lower == 0 else lower - 0.5) + self.cfg.down_hysteresis

    def _capped(self, target: int) -> int:
        if self.cfg.ceiling_coeff <= 0:
            return target
        ceiling = max(1, math.ceil(self._ema * self.cfg.ceiling_coeff))
        if target <= ceiling:
            return target
        below = [s for s in self._cands if s <= ceiling]
        return below[-1] if below else self._cands[0]

    def _may_upshift(self, level: int) -> bool:
        return self._batches >= self._blocked_until.get(level, 0)

    def _switch(self, target: int) -> None:
        old = self._steps
        if target > old:
            if self._pending_up is not None:
                self._judge_upshift(failed=False)  # the earlier upshift held: it led further up
            if old == 0 and self._ema < 0:
                self._ema = float(target - 1)  # a probe from a never-measured EMA
            self._pending_up = (old, self._batches)
        elif self._pending_up is not None:
            self._judge_upshift(failed=target <= self._pending_up[0])
        self._steps = target
        self._switches += 1
        self._last_switch = self._batches
        self._lean = (0, 0)

    def _judge_upshift(self, failed: bool) -> None:
        assert self._pending_up is not None
        level = self._pending_up[0]
        self._pending_up = None
        if not failed:
            self._failures.pop(level, None)
            return
        self._failed_upshifts += 1
        k = self._failures.get(level, 0) + 1
        self._failures[level] = k
        wait = min(self._backoff * 2 ** min(k - 1, 62), self._backoff_max)
        self._blocked_until[level] = self._batches + wait


def _closest(cands: tuple[int, ...], initial: int | None) -> int:
    """`initial` if it is a candidate, else the nearest one (ties: the lower); None: the middle."""
    if initial is None:
        return cands[(len(cands) - 1) // 2]
    return min(cands, key=lambda s: (abs(s - initial), s))
