"""The grammar constraint travels router -> scheduler API -> node unchanged, for every kind."""

from __future__ import annotations

import pytest

from common.sampling import CONSTRAINT_KINDS, Constraint, InvalidRequest, SamplingParams
from engine.service.convert import sampling_params
from router.contract import GenerationJob
from router.wire import build_request


@pytest.mark.parametrize("kind", CONSTRAINT_KINDS)
def test_each_kind_round_trips(kind: str) -> None:
    c = Constraint(kind, '{"type": "object"}' if kind != "regex" else "[0-9]+")
    job = GenerationJob("r", (1, 2, 3), SamplingParams(max_new_tokens=4, constraint=c))
    sp = sampling_params(build_request(job, "r", 1, None), 64)
    assert sp.constraint == c


def test_no_constraint_stays_none() -> None:
    job = GenerationJob("r", (1,), SamplingParams(max_new_tokens=4))
    assert sampling_params(build_request(job, "r", 1, None), 64).constraint is None


def test_bad_constraints_are_refused_by_name() -> None:
    for c in (Constraint("yaml", "x"), Constraint("regex", "")):
        with pytest.raises(InvalidRequest, match="constraint"):
            SamplingParams(constraint=c).check()
