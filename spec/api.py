"""The public API speculative-algorithm plugins build on: import from here, nothing else.

A plugin subclasses `CustomSpecAlgo`, answers the extension points it cares about, and returns an
`Executor` from `create_worker`, usually a `WorkerBase` subclass that overrides only the hooks its
algorithm changes (`plan_decode` for its decode windows, `launch` / `collect`). The names below
are what such a worker needs: the engine's vocabulary and model runner, the FutureMap relay the
scheduler hands each launch, the handoff codec protocol for PD, verification helpers that keep
output exact, and the conformance kit.
Examples: spec/ngram.py (in tree) and examples/standalone (an installable package).
"""

from __future__ import annotations

from engine.core import Batch, DecodePlan, ForwardMode, Req, SamplingParams, StepOutput
from engine.algorithm import EngineParts
from engine.executor import (
    Executor,
    HostCopy,
    build_input_ids,
    last_token_rows,
    maybe_enable_cuda_graphs,
    sample_positions,
    sample_tokens,
    sampled_output,
    sampling_reqs,
    scatter_to_batch,
    seed_prebuilt_rows,
)
from engine.future_map import BatchRelay, DraftInput, FutureMap, RelayPayload
from engine.h2d import to_device
from engine.handoff import HandoffCodec, HandoffError, NoPayloadCodec
from engine.kv_cache import KVPool
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.spec_stats import SpecStats
from engine.worker import PlainExecutor, WorkerBase
from spec.verify_step import accepted_rows, emit_device, host_output, step_output, verify_window
from spec.config import MAX_WINDOW, SpecConfig, SpecConfigError
from spec.draft_input import BonusDraftInput, DisaggHandoffError, bonus_draft_input, check_prebuilt, seed_prebuilt
from spec.registry import CustomSpecAlgo, SpeculativeAlgorithm, SpecRegistryError, register
from spec.tree import DraftTree, chain_tree
from spec.jump_forward import forced_drafts, offer_forced_drafts
from spec.rejection import VerifyResult
from spec.windows import emitted_window, last_accepted_rows, shifted_tokens

__all__ = [
    "Batch",
    "BatchRelay",
    "BonusDraftInput",
    "CustomSpecAlgo",
    "DecodePlan",
    "DisaggHandoffError",
    "DraftInput",
    "DraftTree",
    "EngineParts",
    "Executor",
    "ForwardMode",
    "FutureMap",
    "HandoffCodec",
    "HandoffError",
    "HostCopy",
    "KVPool",
    "MAX_WINDOW",
    "ModelRunner",
    "NoPayloadCodec",
    "PlainExecutor",
    "RelayPayload",
    "Req",
    "Sampler",
    "SamplingParams",
    "SpecConfig",
    "SpecConfigError",
    "SpecRegistryError",
    "SpecStats",
    "SpeculativeAlgorithm",
    "StepOutput",
    "VerifyResult",
    "WorkerBase",
    "accepted_rows",
    "bonus_draft_input",
    "build_input_ids",
    "chain_tree",
    "check_prebuilt",
    "emit_device",
    "emitted_window",
    "forced_drafts",
    "host_output",
    "last_accepted_rows",
    "last_token_rows",
    "load_model",
    "maybe_enable_cuda_graphs",
    "offer_forced_drafts",
    "register",
    "sample_positions",
    "sample_tokens",
    "sampled_output",
    "sampling_reqs",
    "scatter_to_batch",
    "seed_prebuilt",
    "seed_prebuilt_rows",
    "shifted_tokens",
    "step_output",
    "to_device",
    "verify_window",
]
