"""Live: a real Prometheus scrapes a real local stack (two PD routers -> prefill + decode, a colocated
router -> colocated node, all with the built-in pair and EAGLE), traffic goes through, and every
dashboard query and recording rule returns data; the dashboard picture is drawn from it.

Set PDSERVE_DASHBOARD_PNG=deploy/grafana/dashboard.png to refresh the README's picture."""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.kv_transfer import nixl_available
from tests.deploy.livekit import FlakyDecode, Prometheus, drive, get_json, orphan_decode, wait_http_ok
from tests.deploy.promkit import REPO, binary, dashboard_queries, recording_rules
from fixtures.procs import Node

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]

NODE_START_S = 240.0  # four processes importing torch and loading the pair on 2 shared cores
READY_S = 120.0
SCRAPE_WAIT_S = 30.0
ORPHAN_WAIT_S = 8  # the decode's --waiting-timeout: long enough for real prefills on a busy CPU

# Panels whose data the stack cannot produce yet, and why. Remove an entry once it is wired; the
# test then insists on data for it (and fails while the entry stays but data shows up).
PENDING: dict[str, str] = {}


def _has_finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _node(role: str, *extra: str) -> Node:
    # No --model: the built-in pair, EAGLE on (so acceptance is real, PD and colocated alike).
    return Node(
        [
            role,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--max-running",
            "8",
            "--max-total-tokens",
            "8192",
            *extra,
        ]
    )


def _pd_router(policy: str, prefill: Node, decode: Node, flaky: FlakyDecode) -> Node:
    return Node(
        [
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--prefill",
            f"127.0.0.1:{prefill.ports['scheduler']},{prefill.ports['bootstrap']}",
            "--decode",
            f"127.0.0.1:{decode.ports['scheduler']}",
            "--decode",
            flaky.address,
            "--pd-prefill-policy",
            policy,
        ]
    )


def test_dashboard_and_rules_on_a_live_stack(tmp_path: Path) -> None:
    prom_bin = binary("prometheus")
    procs: list[Node] = []
    flaky: FlakyDecode | None = None
    prom: Prometheus | None = None
    try:
        prefill = _node("prefill", "--bootstrap-port", "0")
        # generating nodes adapt their draft steps (the dashboard's adaptive panel)
        decode = _node("decode", "--waiting-timeout", str(ORPHAN_WAIT_S), "--speculative-adaptive")
        colocated = _node("serve", "--speculative-adaptive")
        procs += [prefill, decode, colocated]
        flaky = FlakyDecode()
        for n in (prefill, decode, colocated):
            n.wait_ready(NODE_START_S)
        # Every request through the first PD router transfers KV (the transfer panels and rules);
        # the second decides each prompt's node (the prefill path panels: estimates behind every
        # choice), which on this stack may well be the decode node for all of them.
        pd_routers = [_pd_router(policy, prefill, decode, flaky) for policy in ("remote", "auto")]
        colo_router = Node(
            ["router", "--host", "127.0.0.1", "--port", "0", "--colocated", f"127.0.0.1:{colocated.ports['scheduler']}"]
        )
        procs += [*pd_routers, colo_router]
        for r in (*pd_routers, colo_router):
            r.wait_ready(READY_S)
        pd_urls = [f"http://127.0.0.1:{r.ports['http']}" for r in pd_routers]
        colo_url = f"http://127.0.0.1:{colo_router.ports['http']}"
        prom = Prometheus(
            prom_bin,
            tmp_path,
            {
                "pdserve-router": [f"127.0.0.1:{r.ports['http']}" for r in (*pd_routers, colo_router)],
                "pdserve-nodes": [f"127.0.0.1:{n.ports['metrics']}" for n in (prefill, decode, colocated)],
            },
        )
        prom.wait_ready()
        for url in (*pd_urls, colo_url):
            wait_http_ok(f"{url}/ready", READY_S)  # a real handoff went through
        model = get_json(f"{pd_urls[0]}/v1/models")["data"][0]["id"]

        start = time.time()
        with ThreadPoolExecutor(1) as pool:
            orphan = pool.submit(orphan_decode, decode.ports["scheduler"], prefill.ports["bootstrap"])
            drive(pd_urls, colo_url, model)
            orphan.result(timeout=90)
        window = f"{int(time.time() - start) + 30}s"  # every query sees the whole traffic

        # Bounded wait until the scrapes after the traffic have landed and the rules evaluated.
        checks = [(f"panel {title!r}", q) for title, q in dashboard_queries(window) if title not in PENDING] + [
            (f"rule {r}", r) for r in recording_rules()
        ]
        deadline = time.monotonic() + SCRAPE_WAIT_S
        while True:
            empty = [(name, q) for name, q in checks if not _has_finite(prom.query(q))]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert set(prom.targets_up().values()) == {1.0}, prom.targets_up()
        assert not empty, "no data for:\n" + "\n".join(f"{n}: {q}" for n, q in empty)
        pending = [(t, q) for t, q in dashboard_queries(window) if t in PENDING and prom.query(q)]
        assert not pending, f"data arrived for panels still marked PENDING: {pending}"

        # What the traffic did shows where it should.
        assert prom.query('pdserve_node_finished_requests_total{reason="abort"} > 0')
        assert prom.query('pdserve_router_requests_total{status="400"} > 0')
        assert prom.query('pdserve_kv_transfer_failures_total{role="decode",reason="waiting_timeout"} > 0')
        assert prom.query("sum(pdserve_router_retries_total) > 0")
        assert prom.query(f'pdserve_router_breaker_state{{node="{flaky.address}"}} > 0')  # open or half-open
        assert prom.query('pdserve_spec_verifies_total{role="decode"} > 0')
        assert prom.query('pdserve_spec_verifies_total{role="colocated"} > 0')

        # The dashboard picture from the same data.
        from importlib import util

        spec = util.spec_from_file_location("pdserve_render", REPO / "deploy" / "grafana" / "render.py")
        assert spec is not None and spec.loader is not None
        render = util.module_from_spec(spec)
        spec.loader.exec_module(render)
        out = Path(os.environ.get("PDSERVE_DASHBOARD_PNG", tmp_path / "dashboard.png"))
        counts = render.render(prom.url, start - 5, time.time(), out, window="10s")
        assert out.stat().st_size > 20_000
        assert [t for t, n in counts.items() if n == 0] == sorted(PENDING)
    finally:
        for p in reversed(procs):
            p.kill()
        if flaky is not None:
            flaky.stop()
        if prom is not None:
            prom.stop()
