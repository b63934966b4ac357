"""Adaptive speculative steps: per batch-size range, an EMA of accepted drafts picks the step count."""

from spec.adaptive.config import DEFAULT_ADAPTIVE_CONFIG, AdaptiveConfig, AdaptiveConfigError, SlotConfig
from spec.adaptive.controller import AdaptivePolicy, AdaptiveSteps
from spec.adaptive.slot import StepSlot

__all__ = [
    "DEFAULT_ADAPTIVE_CONFIG",
    "AdaptiveConfig",
    "AdaptiveConfigError",
    "AdaptivePolicy",
    "AdaptiveSteps",
    "SlotConfig",
    "StepSlot",
]
