"""The router's ledger of prompts in flight: whole prompts for the KV they will hold, only what is
expected to be computed (less the prefix-cache hit) for the queue the path estimates read."""

from __future__ import annotations

import time

import pytest

from router.perf import PromptLedger
from router.prefill_path import decide, local_ttft, remote_ttft
from tests.router.test_prefill_path import RATE, decode, prefill


def test_a_cached_prompt_in_flight_holds_its_whole_kv_but_queues_only_its_uncached_part() -> None:
    ledger = PromptLedger()
    ledger.add("turn", 3000, 11.0, cached=2900)
    assert ledger.total() == 3000 and ledger.since(10.0) == 100
    ledger.add("all cached", 500, 11.0, cached=800)  # its last token is still computed
    assert ledger.total() == 3500 and ledger.since(10.0) == 101
    ledger.add("empty", 0, 11.0)
    assert ledger.since(10.0) == 101


def test_estimates_count_in_flight_follow_ups_by_what_they_compute() -> None:
    p = prefill(loads_at=10.0)
    p.prompts.add("follow-up", 3000, 11.0, cached=2900)
    assert remote_ttft(p, 1000) == pytest.approx((100 + 1000) / RATE)
    d, whole = decode(), decode()
    d.prompts.add("follow-up", 3000, time.monotonic(), cached=2900)
    whole.prompts.add("uncached", 100, time.monotonic())
    assert local_ttft(d, 50, 10, 0.0).seconds == pytest.approx(local_ttft(whole, 50, 10, 0.0).seconds)


def test_a_follow_up_is_not_sent_away_from_its_history_by_another_turn_in_flight() -> None:
    """Another conversation's turn of 4,000 tokens, 3,950 of them cached, just went to the decode:
    counted whole it was 0.4 s of queue, and the next turn went to the prefill and recomputed its
    history there."""
    d = decode()
    d.prompts.add("other turn", 4000, time.monotonic(), cached=3950)
    held = {"decode": 1950, "prefill": 0}
    dec = decide("auto", prefill(queued=600), d, 2000, 64, cached=lambda node: held[node.role])
    assert dec.path == "local", dec
