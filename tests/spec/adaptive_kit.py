"""Shared by the adaptive-steps slot tests: a scripted driver, the plain EMA rule as a baseline,
and a geometric acceptance feed."""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

from spec.adaptive import SlotConfig, StepSlot

Feed = Callable[[int, int], Sequence[int]]  # (batch number from 1, current steps) -> accepted drafts

# Decisions on every batch, the EMA equal to the last batch mean: thresholds can be hit exactly.
EXACT = dict(ema_alpha=1.0, warmup_batches=0, update_interval=1, min_dwell=0, upshift_backoff=0, confirm_decisions=1)


def drive(slot: StepSlot, feed: Feed, batches: int) -> list[tuple[int, int]]:
    """Run `batches` updates; the (batch, new steps) of every switch."""
    events = []
    for n in range(1, batches + 1):
        if slot.update(feed(n, slot.current_steps)):
            events.append((n, slot.current_steps))
    assert slot.batches == batches and slot.switches == len(events)
    return events


class PlainEmaRule:
    """SGLang's merged EMA rule, written here independently as the baseline without anti-flapping:
    no dwell, no backoff, and the upward walk goes as far as the EMA allows (max_up=None) or one
    candidate (max_up=1)."""

    def __init__(
        self,
        cfg: SlotConfig,
        initial: int,
        alpha: float = 0.2,
        warmup: int = 10,
        interval: int = 5,
        max_up: int | None = None,
    ) -> None:
        self.c, self.alpha, self.warmup, self.interval, self.max_up = cfg, alpha, warmup, interval, max_up
        self.current_steps, self.ema, self.n, self.switches = initial, initial - 1.0, 0, 0

    def update(self, d: Sequence[int]) -> bool:
        if not d:
            return False
        if self.current_steps > 0:
            self.ema = (1 - self.alpha) * self.ema + self.alpha * (sum(d) / len(d))
        self.n += 1
        if self.n <= self.warmup or (self.n - self.warmup) % self.interval:
            return False
        cands, e = self.c.candidate_steps, self.ema
        i = j = cands.index(self.current_steps)
        if self.current_steps == 0:
            if i + 1 == len(cands):
                return False
            j = i + 1
            if e < 0:
                self.ema = cands[j] - 1.0
        else:
            while j > 0 and e <= (0.5 if cands[j - 1] == 0 else cands[j - 1] - 0.5) + self.c.down_hysteresis:
                j -= 1
            while (
                j >= i
                and j + 1 < len(cands)
                and e > cands[j] - 0.5 + self.c.up_hysteresis
                and (self.max_up is None or j - i < self.max_up)
            ):
                j += 1
            if cands[j] <= self.current_steps and self.c.ceiling_coeff > 0:
                ceiling = max(1, math.ceil(e * self.c.ceiling_coeff))
                below = [s for s in cands if s <= ceiling]
                j = min(j, cands.index(below[-1] if below else cands[0]))
        changed = cands[j] != self.current_steps
        self.current_steps, self.switches = cands[j], self.switches + changed
        return changed


def geometric_feed(p: float, seed: int, batch_size: int = 1) -> Feed:
    """Each request accepts each further draft with probability p, at most `steps` drafts: a real
    draft's acceptance depends on the step count it ran with."""
    rng = random.Random(seed)

    def feed(_: int, steps: int) -> list[int]:
        out = []
        for _ in range(batch_size):
            k = 0
            while k < steps and rng.random() < p:
                k += 1
            out.append(k)
        return out

    return feed
