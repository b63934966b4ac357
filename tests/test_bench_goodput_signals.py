"""The goodput benchmark's per-point signals: requests by path and the router's TTFT stages,
every node's queue and prompt time, its eager forwards and mixed steps, and the decode nodes' TPOT guard
it deploys with."""

from __future__ import annotations

import pytest


def test_a_points_router_counters_give_paths_and_mean_ttft_stages() -> None:
    from bench.gpu.goodput_signals import point_counters

    prefill = 'pdserve_router_ttft_stage_seconds_%s{stage="prefill"}'
    queue = 'pdserve_router_ttft_stage_seconds_%s{stage="queue"}'
    before = {"path:remote": 4.0, prefill % "sum": 0.2, prefill % "count": 4.0}
    after = {"path:remote": 10.0, "path:local": 2.0, prefill % "sum": 0.8, prefill % "count": 12.0}
    after |= {queue % "sum": 0.0, queue % "count": 0.0}  # no request went through a stage: no mean
    whole = 'pdserve_router_time_to_first_token_seconds_%s{endpoint="/v1/completions"}'
    after |= {whole % "sum": 0.9, whole % "count": 8.0}  # the router's own TTFT, whole
    paths, stages = point_counters(before, after)
    assert paths == {"remote": 6.0, "local": 2.0}
    assert stages == {"prefill": pytest.approx(1e3 * 0.6 / 8), "router_total": pytest.approx(1e3 * 0.9 / 8)}


def test_decode_nodes_guard_their_tpot_under_the_tighter_slo() -> None:
    """PD's decode node runs prompts within 0.9 x the tight TPOT when it mixes (the default; 0.8 x
    when not), unless told."""
    from bench.gpu.goodput import local_guard_ms, parse_args, run_settings

    args = parse_args([])
    settings, _ = run_settings(args, "llama8b")
    assert local_guard_ms(args, settings) == pytest.approx(13.5)  # per step
    told = parse_args(["--local-prefill-tpot-ms", "20"])
    assert local_guard_ms(told, settings) == 20.0
    assert local_guard_ms(parse_args(["--disable-mixed-chunk"]), settings) == pytest.approx(12.0)


def test_node_stage_means_by_node() -> None:
    from bench.gpu.goodput_signals import node_stage_means_ms

    prompt = 'decode-0:pdserve_node_prompt_seconds_%s{role="decode"}'
    queue = 'prefill-0:pdserve_node_queue_time_seconds_%s{role="prefill"}'
    before = {prompt % "sum": 1.0, prompt % "count": 10.0, queue % "sum": 0.1, queue % "count": 10.0}
    after = {prompt % "sum": 1.5, prompt % "count": 20.0, queue % "sum": 0.1, queue % "count": 10.0}
    assert node_stage_means_ms(before, after) == {"decode-0": {"prompt": pytest.approx(50.0)}}


def test_node_stage_means_keep_stage_labels() -> None:
    from bench.gpu.goodput_signals import node_stage_means_ms

    handover = 'prefill-0:pdserve_kv_handoff_stage_seconds_%s{stage="handover"}'
    tail = "prefill-0:pdserve_kv_handoff_tail_seconds_%s{}"  # histogram_totals keeps empty labels
    before = {handover % "sum": 0.0, handover % "count": 0.0, tail % "sum": 0.0, tail % "count": 0.0}
    after = {handover % "sum": 0.02, handover % "count": 4.0, tail % "sum": 0.04, tail % "count": 4.0}
    assert node_stage_means_ms(before, after) == {
        "prefill-0": {"kv_handoff_stage:handover": pytest.approx(5.0), "kv_handoff_tail": pytest.approx(10.0)}
    }


def test_point_decisions_count_reasons_and_mean_estimates() -> None:
    from bench.gpu.goodput_signals import point_decisions

    est = 'pdserve_router_prefill_path_estimate_seconds_%s{path="%s"}'
    before = {
        "reason:faster_local": 2.0,
        "reason:faster_remote": 5.0,
        est % ("sum", "local"): 0.1,
        est % ("count", "local"): 1.0,
    }
    after = {
        "reason:faster_local": 5.0,
        "reason:faster_remote": 5.0,
        est % ("sum", "local"): 0.4,
        est % ("count", "local"): 4.0,
    }
    reasons, estimates = point_decisions(before, after)
    assert reasons == {"faster_local": 3.0}  # reasons no decision gave in the point are left out
    assert estimates == {"local": pytest.approx(100.0)}


def test_node_env_carries_the_prefills_kv_write_sgl() -> None:
    from bench.gpu.goodput import parse_args
    from bench.gpu.goodput_up import node_env

    assert node_env(None, kv_write_sgl="auto")["PDSERVE_KV_WRITE_SGL"] == "auto"
    assert node_env(None, switch_interval_ms=0.5)["PDSERVE_SWITCH_INTERVAL_MS"] == "0.5"
    assert "PDSERVE_SWITCH_INTERVAL_MS" not in node_env(None)
    assert node_env(None, prompt_graph_tokens=2048)["PDSERVE_CUDA_GRAPH_PROMPT_TOKENS"] == "2048"
    assert "PDSERVE_CUDA_GRAPH_PROMPT_TOKENS" not in node_env(None)
    assert node_env(None, stream_interval=4)["PDSERVE_STREAM_INTERVAL"] == "4"
    assert "PDSERVE_STREAM_INTERVAL" not in node_env(None)
    assert parse_args(["--stream-interval", "4"]).stream_interval == 4
    assert parse_args(["--stream-interval", "auto"]).stream_interval == "auto"
    assert node_env(None, stream_interval="auto")["PDSERVE_STREAM_INTERVAL"] == "auto"
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            parse_args(["--stream-interval", bad])
    assert parse_args(["--kv-write-sgl", "on"]).kv_write_sgl == "on"


def test_node_count_means_give_a_decodes_page_runs_per_prompt() -> None:
    from bench.gpu.goodput_signals import node_count_means

    runs = "decode-0:pdserve_kv_destination_runs_%s{}"
    queue = "decode-0:pdserve_node_queue_time_seconds_%s{}"  # a time stage: not a count
    before = {runs % "sum": 10.0, runs % "count": 5.0, queue % "sum": 0.0, queue % "count": 0.0}
    after = {runs % "sum": 22.0, runs % "count": 9.0, queue % "sum": 1.0, queue % "count": 2.0}
    assert node_count_means(before, after) == {"decode-0": {"kv_destination_runs": pytest.approx(3.0)}}
    # a prefill's runs per write, by write kind
    final = 'prefill-0:pdserve_kv_write_runs_%s{kind="final"}'
    chunk = 'prefill-0:pdserve_kv_write_runs_%s{kind="chunk"}'
    before = {final % "sum": 0.0, final % "count": 0.0, chunk % "sum": 0.0, chunk % "count": 0.0}
    after = {final % "sum": 4.0, final % "count": 4.0, chunk % "sum": 12.0, chunk % "count": 3.0}
    assert node_count_means(before, after) == {"prefill-0": {"kv_write_runs:final": 1.0, "kv_write_runs:chunk": 4.0}}


def test_a_points_calibration_is_each_roles_ratio_at_its_end() -> None:
    import asyncio

    import httpx

    from bench.gpu.goodput_signals import point_calibration, point_counters, router_counters

    text = (
        'pdserve_router_ttft_estimate_ratio{node="127.0.0.1:1",role="prefill"} 0.9\n'
        'pdserve_router_ttft_estimate_ratio{node="127.0.0.1:2",role="decode"} 1.65\n'
        'pdserve_router_prefill_path_total{path="local"} 3.0\n'
    )
    transport = httpx.MockTransport(lambda req: httpx.Response(200, text=text))

    async def read() -> dict[str, float]:
        async with httpx.AsyncClient(transport=transport) as client:
            return await router_counters(client, "http://router")

    after = asyncio.run(read())
    assert point_calibration(after) == {"prefill": 0.9, "decode": 1.65}  # read as they are, not diffed
    assert point_counters({}, after)[0] == {"local": 3.0}  # and they are no path


def test_node_counter_deltas_give_a_points_eager_forwards_by_reason_and_mixed_steps() -> None:
    from bench.gpu.goodput_signals import node_counter_deltas

    eager = 'decode-0:pdserve_node_graph_forwards_total{role="decode",path="eager",reason="not captured at start-up"}'
    replay = 'decode-0:pdserve_node_graph_forwards_total{role="decode",path="replay",reason=""}'
    mixed = 'decode-0:pdserve_node_mixed_steps_total{role="decode"}'
    queue = "decode-0:pdserve_node_queue_time_seconds_sum{}"  # not a counter of the point
    compiles = "decode-0:pdserve_node_kernel_compiles_total{}"
    compile_s = 'decode-0:pdserve_node_kernel_compile_seconds_total{kernel="_extend_kernel"}'
    before = {eager: 3.0, replay: 100.0, mixed: 1.0, queue: 0.0, compiles: 40.0, compile_s: 9.0}
    after = {eager: 5.0, replay: 160.0, mixed: 1.0, queue: 2.0, compiles: 41.0, compile_s: 9.5}
    assert node_counter_deltas(before, after) == {
        "decode-0": {
            "graph_forwards:eager,not captured at start-up": 2.0,
            "graph_forwards:replay": 60.0,
            "kernel_compiles": 1.0,  # one compile during the point: a step waited 0.5 s for it
            "kernel_compile_seconds:_extend_kernel": 0.5,
        }
    }


def _step_exposition(decode: list[float], mixed: list[float]) -> str:
    """A node's step histogram as prometheus_client writes it, with these step times observed."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    registry = CollectorRegistry()
    bounds = (0.005, 0.01, 0.05, 0.1, 0.25, 1.0, 2.5)
    h = Histogram("pdserve_node_step_seconds", "", ["kind", "role"], buckets=bounds, registry=registry)
    for kind, times in (("decode", decode), ("mixed", mixed)):
        for t in times:
            h.labels(kind=kind, role="decode").observe(t)
    return generate_latest(registry).decode()


def test_a_points_step_tails_name_the_steps_a_mean_hides() -> None:
    """One 1.8-s step among a hundred 6-ms ones moves their mean by 18 ms; the tails name it."""
    from bench.gpu.goodput_signals import STEP_BUCKETS, node_step_tails, samples

    def snapshot(text: str) -> dict[str, float]:
        return {f"decode-0:{n}{{{labels}}}": v for n, labels, v in samples(text) if n == STEP_BUCKETS}

    before = snapshot(_step_exposition([0.006] * 50, [0.009] * 5))
    after = snapshot(_step_exposition([0.006] * 150 + [1.8], [0.009] * 5 + [0.2]))
    tails = node_step_tails(before, after)
    assert tails == {
        "decode-0": {
            "decode": {"steps": 101.0, "slow": 1.0, "longest_at_least_ms": 1000.0},
            "mixed": {"steps": 1.0, "slow": 1.0, "longest_at_least_ms": 100.0},
        }
    }
    assert node_step_tails(after, after) == {}  # no step in between: nothing to say


def test_stream_stalls_tell_a_stalled_service_from_a_slow_stream() -> None:
    """Two requests streaming side by side: a 2-s hole in both is a silence of the service; a
    request waiting alone while the other streams is only a gap."""
    from loadgen.metrics import RequestRecord, stream_stalls

    ticks = [0.01 * i for i in range(100)]  # a chunk every 10 ms for a second
    a = RequestRecord(0, 8, 8, start=0.0, chunk_times=ticks + [t + 3.0 for t in ticks])
    b = RequestRecord(1, 8, 8, start=0.005, chunk_times=ticks + [t + 3.0 for t in ticks])
    stalled = stream_stalls([a, b])
    assert stalled["longest_silence_ms"] == pytest.approx(2005.0)  # from b's last tick to a's next
    assert stalled["silence_at_s"] == pytest.approx(0.995)
    c = RequestRecord(2, 8, 8, start=0.0, chunk_times=[0.0, 3.0])  # waits alone while `d` streams
    d = RequestRecord(3, 8, 8, start=0.0, chunk_times=[0.01 * i for i in range(301)])
    slow = stream_stalls([c, d])
    assert slow["longest_gap_ms"] == pytest.approx(3000.0)
    assert slow["longest_silence_ms"] == pytest.approx(10.0)
    assert stream_stalls([RequestRecord(4, 8, 8)]) == {
        "longest_gap_ms": None,
        "longest_silence_ms": None,
        "silence_at_s": None,
    }


def _router_exposition(cpu_s: float, lags: list[float]) -> str:
    """A router's /metrics with its process CPU, these event-loop lags observed and its pacing."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from common.loop_lag import LAG_BUCKETS

    registry = CollectorRegistry()
    Counter("process_cpu_seconds", "", registry=registry).inc(cpu_s)
    Gauge("pdserve_router_stream_interval_tokens", "", registry=registry).set(3)
    h = Histogram("pdserve_router_event_loop_lag_seconds", "", buckets=LAG_BUCKETS, registry=registry)
    for lag in lags:
        h.observe(lag)
    return generate_latest(registry).decode()


def test_a_points_router_load_says_whether_its_one_loop_ran_out_of_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """0.9 s of CPU in a second, 200 wake-ups of which 3 over 50 ms late: a router near its core."""
    import asyncio

    import httpx

    from bench.gpu import goodput_signals as sig

    def snapshot(text: str, clock: float) -> dict[str, float]:
        monkeypatch.setattr(sig.time, "monotonic", lambda: clock)
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))

        async def read() -> dict[str, float]:
            async with httpx.AsyncClient(transport=transport) as client:
                return await sig.router_counters(client, "http://router")

        return asyncio.run(read())

    before = snapshot(_router_exposition(2.0, [0.001] * 50), clock=10.0)
    after = snapshot(_router_exposition(2.9, [0.001] * 247 + [0.08, 0.12, 0.3]), clock=11.0)
    load = sig.point_router_load(before, after)
    assert load["cpu_cores"] == pytest.approx(0.9)
    assert load["loop_lags_over_50ms"] == 3
    assert load["loop_lag_ms_mean"] == pytest.approx((0.197 + 0.5) / 200 * 1e3, rel=1e-3)
    assert load["stream_interval_tokens"] == 3  # what it asked of new requests at the point's end
    assert sig.point_router_load({}, {}) == {}  # a router that exported none of them
