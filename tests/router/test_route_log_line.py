"""The router's debug line per request: its path, the reason, and what each node of the route held."""

from __future__ import annotations

import logging

import pytest

from bench.route_log import route_summary
from tests.router.fake_nodes import FakeNode, cluster, collect, dispatcher, job, run


def test_each_route_is_one_debug_line_with_its_path_reason_and_what_the_nodes_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        p, d = FakeNode("prefill"), FakeNode("decode")
        async with cluster(p, d) as reg:
            disp = dispatcher(reg)
            with caplog.at_level(logging.DEBUG, logger="router.dispatch"):
                await collect(disp, job("req-routed"))
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("route req-routed:")]
            assert len(lines) == 1, caplog.text
            assert "path remote" in lines[0] and "expected held {'prefill': 0, 'decode': 0}" in lines[0], lines[0]
            assert sum(route_summary(lines[0])["by_reason"].values()) == 1  # the prefix-cache bench reads it
            await disp.close()

    run(main())
