"""A PD handoff done by hand in one process (spec.testing.InProcessPD): what prefill_node + NIXL +
decode_node do, through the same facade, handoff codec and rows."""

from __future__ import annotations

from engine.core import Req, SamplingParams
from engine.engine import Engine
from spec.registry import AlgorithmBinding
from spec.testing import InProcessPD

_pairs: dict[tuple[int, int], InProcessPD] = {}


def hand_off(prefill: Engine, decode: Engine, prompt: list[int], rid: str, params: SamplingParams) -> Req:
    """Prefill `prompt` on one engine (holding its KV like a prefill node), move target + draft KV
    pages and the handoff row to the other, and return the decode side's PREBUILT request with
    `Req.handoff` decoded (not adopted yet)."""
    key = (id(prefill), id(decode))
    if key not in _pairs:
        binding = decode.algorithm
        assert isinstance(binding, AlgorithmBinding)
        _pairs[key] = InProcessPD(prefill, decode, binding)
    return _pairs[key].hand_off(prompt, rid, params)
