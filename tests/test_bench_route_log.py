"""bench/route_log.py reads the router's debug route lines."""

from __future__ import annotations

from bench.route_log import route_summary

PREFIX = "[router] 2026-11-28 09:24:33,764 DEBUG router.dispatch: "


def _line(rid: str, path: str, reason: str, tokens: int, held: str, remote: str, local: str) -> str:
    """A route line as router/dispatch.py writes it."""
    return (
        f"{PREFIX}route {rid}: path {path} ({reason}), {tokens} prompt tokens, expected held {held}, "
        f"estimates remote {remote} ms local {local} ms request_id={rid}\n"
    )


LOG = "".join(
    (
        _line("probe-3a38", "remote", "remote_unmeasured", 8, "{'prefill': 0, 'decode': 0}", "-", "-"),
        _line("a1", "remote", "remote_on_target", 26, "{'prefill': 0, 'decode': 0}", "105.4", "95.1"),
        _line("b2", "local", "short_local", 77, "{'decode': 32}", "206.6", "164.5"),
        _line("c3", "remote", "faster_remote", 353, "{'prefill': 16, 'decode': 320}", "205.3", "332.5"),
        "[decode-0] 2026-11-28 09:24:34,200 DEBUG engine.service.servicer: generate: 353 prompt tokens\n",
        _line("d4", "remote", "remote_on_target", 393, "{'prefill': 352, 'decode': 384}", "32.1", "-"),
    )
)


def test_routes_are_counted_by_path_and_reason_and_history_left_on_the_decode_is_summed() -> None:
    summary = route_summary(LOG)
    assert summary["by_reason"] == {
        "local/short_local": 1,
        "remote/faster_remote": 1,
        "remote/remote_on_target": 2,
    }
    left = summary["remote_with_history_on_decode"]
    assert left == {"requests": 2, "tokens_recomputed": 304 + 32, "local_estimate_ms_p50": 332.5}


def test_a_log_without_route_lines_sums_to_nothing() -> None:
    summary = route_summary("[router] INFO started\n")
    assert summary["by_reason"] == {} and summary["remote_with_history_on_decode"]["requests"] == 0
