"""bench/router_chat_turns.py's conversations and report (the bench itself runs processes; see its docstring)."""

from __future__ import annotations

import random

from bench.router_chat_turns import LATE_TURN, conversation, report


def test_each_turn_resends_the_history_and_ends_with_a_new_user_message() -> None:
    turns = conversation(random.Random(0), 4)
    assert [len(t) for t in turns] == [1, 3, 5, 7]
    assert all(t[-1]["role"] == "user" for t in turns)
    assert turns[3][:5] == turns[2]  # the history is sent again as it was
    assert conversation(random.Random(0), 4) == turns  # the same seed, the same chats for both routers


def test_the_report_compares_the_late_turns_of_both_routers() -> None:
    ttfts = {"cache": [[0.004], [0.004], [0.004], [0.005]], "no_cache": [[0.004], [0.005], [0.006], [0.007]]}
    got = report(ttfts, 1, 4, {}, "pdserve_router_prompt_tokens_reused_total 9.0\nother 1\n")
    assert got["ttft_by_turn"]["cache"][0]["p50_ms"] == 4.0
    assert got[f"ttft_turn{LATE_TURN}plus"]["no_cache"]["n"] == 2
    assert round(got["p50_saving_turn3plus_ms"], 6) == 2.0 and got["cache_metrics"] == [
        "pdserve_router_prompt_tokens_reused_total 9.0"
    ]
