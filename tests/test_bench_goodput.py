"""The goodput benchmark (bench/gpu/goodput*.py): its pure parts (workloads, the rate ladder, the
time budget, goodput from points, the report's layout and plot, the checkpoint writer at a small
shape) fast, and one end-to-end run on CPU (tiny model, --quick) through real `pdserve up`s."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bench.gpu import goodput_plan as plan
from bench.gpu.goodput_report import DEPLOYMENTS, SLO_NAMES, Results, point_entries, summary_text
from bench.gpu.goodput_settings import parse_deployments
from bench.gpu.goodput_up import busy_requests, up_argv
from bench.gpu.goodput_workloads import FIRST_ID, WORKLOADS, Lengths, make_requests
from loadgen.metrics import RequestRecord

REPO = Path(__file__).resolve().parent.parent
LOOSE, TIGHT = {"ttft": 0.5, "tpot": 0.025}, {"ttft": 0.25, "tpot": 0.015}


# ---- workloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_workloads_are_seeded_and_within_their_bounds(kind: str) -> None:
    for w in WORKLOADS[kind]:
        reqs = make_requests(w, 300, seed=7, vocab=4096)
        assert reqs == make_requests(w, 300, seed=7, vocab=4096)  # the same in every process
        assert reqs != make_requests(w, 300, seed=8, vocab=4096)
        assert [r.index for r in reqs] == list(range(300))
        for r in reqs:
            assert isinstance(r.prompt, list) and len(r.prompt) == r.input_len  # exact: token ids
            assert all(FIRST_ID <= i < 4096 for i in r.prompt)
            assert w.prompt.low <= r.input_len <= w.prompt.most and w.output.low <= r.output_len <= w.output.most
        ins = sorted(r.input_len for r in reqs)
        if w.prompt.sigma == 0:
            assert set(ins) == {w.prompt.median} and {r.output_len for r in reqs} == {w.output.median}
        else:  # long-tailed: about half below the median, a tail well above it
            assert ins[0] < w.prompt.median < ins[-1] and 0.35 < ins.index(w.prompt.median) / 300 < 0.65
            assert ins[-1] > 3 * w.prompt.median
    names = [w.name for w in WORKLOADS[kind]]
    assert names == ["prefill_heavy", "decode_heavy", "chat_mix"]


def test_gpu_workloads_are_the_asked_ones() -> None:
    fixed = {w.name: (w.prompt.median, w.output.median) for w in WORKLOADS["llama8b"] if w.prompt.sigma == 0}
    assert fixed == {"prefill_heavy": (2048, 150), "decode_heavy": (1024, 256)}


def test_lengths_refuse_nonsense() -> None:
    for bad in ((10, 0.0, 11, 20), (10, -1.0, 1, 20), (30, 1.0, 1, 20)):
        with pytest.raises(ValueError):
            Lengths(*bad)
    with pytest.raises(ValueError, match="no ids"):
        make_requests(WORKLOADS["tiny"][0], 1, 0, vocab=FIRST_ID)


# ---- the rate ladder and the time budget --------------------------------------------------------


def test_requests_cut_and_budget() -> None:
    assert plan.requests_at(0.5, 6, 24, 200) == 24 and plan.requests_at(10, 6, 24, 200) == 60
    assert plan.requests_at(100, 6, 24, 200) == 200
    # within both limits a 150-token request ends by 0.5 + 149 * 0.025 s; it is cut a little later
    assert plan.cut_after_s(LOOSE, 150) == pytest.approx((0.5 + 149 * 0.025) * 1.1 + 0.25)
    assert plan.point_estimate_s(60, 10, 2.5) == 8.5
    budget = plan.Budget(deadline=100.0, curves_per_deployment=3, deployments_left=2, start_s=10, stop_s=5)
    assert budget.curve_end(0.0) == pytest.approx((100 - 15 - 5) / 6)  # one more start + stop, this stop
    budget.curve_done()
    assert budget.curve_end(40.0) == pytest.approx(40 + (60 - 20) / 5)
    budget.deployment_done()
    assert budget.curve_end(90.0) == pytest.approx(90 + 5 / 3)
    assert plan.curve_deadline(99.0, 100.0, 2, 50.0) == 99.0  # out of time: the curve ends at once


# ---- points, goodput and the report -----------------------------------------------------------


def _record(i: int, ttft: float, tpot: float, tokens: int = 11, error: str | None = None) -> RequestRecord:
    e2e = ttft + tpot * (tokens - 1)
    return RequestRecord(i, 8, tokens, ttft=ttft, chunk_times=[ttft, e2e], e2e=e2e, output_tokens=tokens, error=error)


def test_a_point_is_judged_by_each_slo_on_the_same_requests() -> None:
    records = [
        _record(0, 0.1, 0.010),  # within both
        _record(1, 0.3, 0.010),  # TTFT over the tight limit only
        _record(2, 0.1, 0.020),  # TPOT over the tight limit only
        _record(3, 0.6, 0.010),  # over both
        RequestRecord(4, 8, 11, error="timeout after 4.5 s"),  # cut: within neither
    ]
    entries = point_entries("pd", 4.0, records, 2.0, {"loose": LOOSE, "tight": TIGHT})
    assert entries["loose"]["attainment"] == 3 / 5 and entries["tight"]["attainment"] == 1 / 5
    for e in entries.values():
        assert (e["deployment"], e["rate"], e["requests"], e["completed"], e["cut"]) == ("pd", 4.0, 5, 4, 1)
        assert e["request_throughput"] == 2.0 and e["output_throughput"] == 22.0
        for key in ("ttft_ms", "tpot_ms"):
            assert e[key]["p50"] <= e[key]["p90"] <= e[key]["p99"]
    assert entries["loose"]["ttft_ms"]["p50"] == pytest.approx(200)


def _results(curves: dict[str, list[tuple[float, float, float]]]) -> Results:
    """Results of one workload from (rate, loose, tight) attainments per deployment."""
    results = Results({"device": "cpu", "slos": {"loose": {"ttft_ms": 500.0}, "tight": {"ttft_ms": 250.0}}})
    results.workload("w", {"description": "test"})
    for dep, points in curves.items():
        for rate, loose, tight in points:
            for slo, share in (("loose", loose), ("tight", tight)):
                # ten requests, `share` of them within the SLO (the rest over its TTFT limit)
                limit = {"loose": LOOSE, "tight": TIGHT}[slo]
                recs = [_record(i, 0.01 if i < round(share * 10) else 1.0, 0.001) for i in range(10)]
                results.add_point("w", {slo: point_entries(dep, rate, recs, 1.0, {slo: limit})[slo]}, drained=True)
    return results


def test_goodput_follows_the_definition_from_the_points(tmp_path: Path) -> None:
    results = _results(
        {
            "pd": [(2, 1.0, 1.0), (4, 1.0, 0.8), (8, 0.9, 0.2), (16, 0.3, 0.0)],
            "colocated": [(2, 1.0, 0.5), (4, 1.0, 0.4), (8, 1.0, 0.1)],
        }
    )
    path, png = results.write(tmp_path, "cpu")
    data = json.loads(path.read_text())
    assert path.name == "goodput_cpu.json" and png is not None and png.stat().st_size > 10_000
    assert data["device"] == "cpu" and set(data["workloads"]) == {"w"}
    block = data["workloads"]["w"]
    assert (block["loose"]["pd_goodput"], block["loose"]["colocated_goodput"]) == (8, 8)
    assert (block["tight"]["pd_goodput"], block["tight"]["colocated_goodput"]) == (2, None)
    assert block["loose"]["colocated_goodput_is_lower_bound"] and not block["loose"]["pd_goodput_is_lower_bound"]
    assert data["highest_rate_within_loose_slo"] == {"w": {"pd": 8, "colocated": 8}}
    for slo in SLO_NAMES:
        for dep in DEPLOYMENTS:
            mine = [(p["rate"], p["attainment"]) for p in block[slo]["points"] if p["deployment"] == dep]
            assert block[slo][f"{dep}_goodput"] == max((r for r, a in mine if a >= 0.9), default=None)
    assert "w              tight          2         none         -" in summary_text(data)
    # the benchmark's goals: PD level on loose, unknown against a colocated with no tight goodput
    assert data["goals"] == {
        "pd_over_colocated": {"w": {"loose": 1.0, "tight": None}},
        "every_curve_at_least_colocated": False,
        "tight_workloads_at_1_3x": 0,
        "tight_goal_met": False,
        "loose_highest_rate_goal_met": False,
    }
    assert "goals_by_deployment" not in data


def test_other_pd_deployments_are_judged_against_colocated_too(tmp_path: Path) -> None:
    results = _results(
        {
            "pd": [(2, 1.0, 1.0), (4, 0.5, 0.2)],
            "colocated": [(2, 1.0, 1.0), (4, 1.0, 0.4)],
            "pd_pooled": [(2, 1.0, 1.0), (4, 1.0, 0.95)],
        }
    )
    results.deployment("pd_pooled", {"label": "pooled"})
    data = json.loads(results.write(tmp_path, "cpu")[0].read_text())
    assert data["goals"]["pd_over_colocated"] == {"w": {"loose": 0.5, "tight": 1.0}}
    pooled = data["goals_by_deployment"]["pd_pooled"]
    assert (
        pooled["pd_over_colocated"] == {"w": {"loose": 1.0, "tight": 2.0}} and pooled["every_curve_at_least_colocated"]
    )


# ---- the deployment and the checkpoint ----------------------------------------------------------


def test_both_deployments_start_the_same_way_but_for_their_topology() -> None:
    pd, co = up_argv("pd", Path("/m"), ["--device", "cuda"]), up_argv("colocated", Path("/m"), ["--device", "cuda"])
    assert pd[2:] == ["pdserve.cli", "up", "--model", "/m", "--port", "0", "--no-isolate-gpus", "--verbose",
                      "--prefill", "1", "--decode", "1", "--pd-prefill-policy", "auto", "--device", "cuda"]  # fmt: skip
    assert co[pd.index("--prefill") : pd.index("--prefill") + 2] == ["--colocated", "2"]
    remote = up_argv("pd_remote", Path("/m"))
    assert remote[remote.index("--pd-prefill-policy") + 1] == "remote"
    pooled = up_argv("pd_pooled", Path("/m"))
    assert pooled[pooled.index("--pd-prefill-policy") + 1] == "auto" and pooled[-2:] == ["--pd-pooling", "auto"]
    always = up_argv("pd_always_pooled", Path("/m"))
    assert always[always.index("--pd-prefill-policy") + 1] == "auto" and always[-2:] == ["--pd-pooling", "always"]
    assert parse_deployments("pd_always_pooled@tight,colocated") == [("pd_always_pooled", "tight"), ("colocated", None)]


def test_busy_requests_read_every_node_gauge() -> None:
    texts = {
        "http://p/metrics": 'pdserve_node_waiting_requests{role="prefill"} 1.0\n'
        'pdserve_node_request_slots_used{role="prefill"} 0.0\n'
        'pdserve_pd_queue_requests{role="prefill",queue="transfer"} 2.0\n'
        'pdserve_node_running_requests_total{role="prefill"} 9.0\n',
        "http://d/metrics": 'pdserve_node_request_slots_used{role="decode"} 3.0\n',
        "http://idle/metrics": 'pdserve_node_waiting_requests{role="colocated"} 0.0\n',
    }
    transport = httpx.MockTransport(lambda req: httpx.Response(200, text=texts[str(req.url)]))

    async def go() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=transport) as client:
            return await busy_requests(client, ["http://p/metrics", "http://d/metrics"]), await busy_requests(
                client, ["http://idle/metrics"]
            )

    assert asyncio.run(go()) == (6, 0)


def test_the_checkpoint_writer_at_a_small_shape(tmp_path: Path) -> None:
    from bench.gpu.goodput_model import write_llama8b_dir
    from engine.loader import load_model

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)  # fmt: skip
    path = write_llama8b_dir(tmp_path / "ckpt", **shape)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 4096 and config["rope_scaling"]["rope_type"] == "llama3"
    model, cfg = load_model(path, device="cpu")
    assert cfg.vocab_size == 4096 and cfg.num_layers == 3
    layers = model.model.layers
    assert all(p.dtype.is_floating_point for p in model.parameters())
    assert (layers[0].mlp.down_proj.weight == layers[2].mlp.down_proj.weight).all()  # one draw, every layer
    stamp = (path / "config.json").stat().st_mtime_ns
    assert write_llama8b_dir(path, **shape) == path and (path / "config.json").stat().st_mtime_ns == stamp
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "weights.bin").write_text("x")
    with pytest.raises(FileExistsError):
        write_llama8b_dir(tmp_path / "theirs", **shape)


def test_the_checkpoint_is_predictable_and_the_echo_head_drafts_it(tmp_path: Path) -> None:
    """32 layers sharing one draw (their branches add up as the 8B's do), a narrow body: greedy
    output is a function of the last token, never a special token, and an echo head's drafts are
    accepted nearly always; speculative output equals plain."""
    from bench.gpu.goodput_model import SPECIAL_IDS, write_llama8b_dir
    from engine.core import SamplingParams
    from engine.engine import Engine, EngineConfig
    from fixtures.tiny_eagle import write_tiny_eagle_head
    from spec.config import SpecConfig
    from spec.registry import bind

    shape = dict(hidden_size=128, intermediate_size=448, num_hidden_layers=32, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32)  # fmt: skip
    path = write_llama8b_dir(tmp_path / "ckpt", **shape)
    head = write_tiny_eagle_head(tmp_path / "head", path, "eagle", mode="echo", intermediate_size=448)
    prompts = [[40 + i, 900 + 7 * i, 3000 - i] for i in range(4)]
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(str(path), dtype="float32", page_size=4, max_total_tokens=512)
    plain = [o.output_ids for o in Engine(cfg).generate(prompts, params)]
    follows: dict[int, int] = {}
    for prompt, out in zip(prompts, plain):
        for cur, nxt in zip([prompt[-1], *out], out):
            assert follows.setdefault(cur, nxt) == nxt and nxt not in SPECIAL_IDS
    eng = Engine(cfg, algorithm=bind(SpecConfig("EAGLE", str(head), 3, 1, None)))
    outs = eng.generate(prompts, params)
    assert [o.output_ids for o in outs] == plain
    accepted = sum(sum(o.accepted_drafts) for o in outs)
    drafted = 3 * sum(len(o.accepted_drafts) for o in outs)
    assert accepted >= 0.9 * drafted


@pytest.mark.slow
def test_a_deployment_that_cannot_start_is_an_error_with_its_log(tmp_path: Path) -> None:
    from bench.gpu.goodput_up import UpProcess, node_env

    missing = tmp_path / "no-such-model"
    up = UpProcess("pd", up_argv("pd", missing, ["--device", "cpu"]), node_env(None), tmp_path / "pd.log")
    with pytest.raises(RuntimeError, match="did not come up") as err, up:
        up.start(timeout_s=60)
    assert str(missing) in str(err.value)  # the nodes' complaint, from the log's tail
    assert not up.alive()
    r = subprocess.run(["pgrep", "-f", str(missing)], capture_output=True, text=True, timeout=10)
    assert r.stdout.split() == []


# ---- end to end on CPU --------------------------------------------------------------------------


@pytest.mark.slow
def test_goodput_bench_end_to_end_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.gpu.goodput import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # five torch processes on two cores, one at a time
    model = tmp_path / "tiny-model"  # a unique path: it names exactly this run's node processes
    out = tmp_path / "out"
    # SLOs this CPU meets at low rates and misses at higher ones, so the ladder has to work
    slos = ["--slo-loose", "ttft=60ms,tpot=6ms", "--slo-tight", "ttft=25ms,tpot=3ms"]
    args = [
        "--model",
        "tiny",
        "--quick",
        "--out",
        str(out),
        "--model-dir",
        str(model),
        "--log-dir",
        str(tmp_path),
        "--workloads",  # two of the three: the suite's time (the third's lengths are tested above)
        "prefill_heavy,chat_mix",
        *slos,
    ]
    start = time.monotonic()
    try:
        code = main(args)
    finally:
        r = subprocess.run(["pgrep", "-f", str(model)], capture_output=True, text=True, timeout=10)
        left = r.stdout.split()
        for pid in left:  # every deployment should be down already; never leave one behind
            subprocess.run(["kill", "-9", pid], timeout=10, check=False)
    assert code == 0 and not left, left
    assert time.monotonic() - start < 150
    data = json.loads((out / "goodput_cpu.json").read_text())
    assert (out / "goodput_cpu.png").stat().st_size > 10_000
    assert data["device"] == "cpu" and set(data["deployments"]) == set(DEPLOYMENTS)
    assert all("error" not in d and d["start_s"] > 0 for d in data["deployments"].values())
    assert list(data["workloads"]) == ["prefill_heavy", "chat_mix"]
    for wname, w in data["workloads"].items():
        assert set(w) >= {"loose", "tight"}
        for slo in SLO_NAMES:
            block = w[slo]
            assert {"pd_goodput", "colocated_goodput", "points"} <= set(block)
            for dep in DEPLOYMENTS:
                mine = [p for p in block["points"] if p["deployment"] == dep]
                assert mine, (wname, slo, dep)  # every curve has at least its first rate
                best = max((p["rate"] for p in mine if p["attainment"] >= 0.9), default=None)
                assert block[f"{dep}_goodput"] == best
            for p in block["points"]:
                assert 0.0 <= p["attainment"] <= 1.0 and p["requests"] >= 6 and p["drained"]
                # every node's load against capacity, and (PD) the router's requests by path
                assert len(p["nodes"]) == 2 and all("prompt_tokens_per_second" in v for v in p["nodes"].values())
                if p["deployment"] == "pd":
                    assert set(p["paths"]) == {"remote", "local", "whole", "colocated"}
                    # every completed request was routed (one the client cut before its route has none);
                    # the bench's prefill nodes run no whole requests unless told (--whole-on-prefill)
                    assert p["paths"]["remote"] + p["paths"]["local"] >= p["completed"] and p["paths"]["whole"] == 0
                    # not pooled (no --pd-pooling), with the recent tier load the router read at the end
                    assert p["pool"]["pooled"] == 0.0 and {"load_prefill", "load_decode", "load_pooled"} <= set(
                        p["pool"]
                    )
                assert p["completed"] + p["failed"] == p["requests"] and p["request_throughput"] >= 0
                for key in ("ttft_ms", "tpot_ms"):  # over completed requests (a loaded CPU may cut all)
                    pcts = [p[key][q] for q in ("p50", "p90", "p99")]
                    assert 0 < pcts[0] <= pcts[1] <= pcts[2] if p["completed"] else pcts == [None] * 3
                assert not math.isnan(p["output_throughput"])
                # where streams stood still, and every node's slowest steps (a mean hides a stall)
                assert set(p["stream_stalls"]) == {"longest_gap_ms", "longest_silence_ms", "silence_at_s"}
                if p["completed"]:
                    assert p["node_step_tails"] and all(
                        t["steps"] >= t["slow"] >= 0 for kinds in p["node_step_tails"].values() for t in kinds.values()
                    )
        # the same runs judged twice: identical points but for attainment
        judged = ("attainment", "good_throughput")
        loose, tight = ([{k: v for k, v in p.items() if k not in judged} for p in w[s]["points"]] for s in SLO_NAMES)
        assert loose == tight
    assert data["highest_rate_within_loose_slo"] == {
        name: {dep: w["loose"][f"{dep}_goodput"] for dep in DEPLOYMENTS} for name, w in data["workloads"].items()
    }


def test_node_and_router_expositions_are_read_for_each_point():
    from bench.gpu.goodput_signals import SIGNALS, samples

    text = "\n".join(
        [
            "# HELP pdserve_node_prompt_tokens_per_second x",
            'pdserve_node_prompt_tokens_per_second{role="prefill"} 31250.5',
            'pdserve_node_decode_capacity_tokens_per_second{role="decode"} 4.1e3',
            'pdserve_node_stream_interval_tokens{role="decode"} 4.0',
            'pdserve_router_prefill_path_total{path="local"} 7.0',
            "pdserve_router_ready 1.0",
        ]
    )
    got = samples(text)
    assert got[0] == ("pdserve_node_prompt_tokens_per_second", 'role="prefill"', 31250.5)
    assert ("pdserve_router_ready", "", 1.0) in got and len(got) == 5
    assert {name for name, _, _ in got} & set(SIGNALS) == {
        "pdserve_node_prompt_tokens_per_second",
        "pdserve_node_decode_capacity_tokens_per_second",
        "pdserve_node_stream_interval_tokens",  # auto's choice at the point's end, per node
    }


def test_each_point_sends_prompts_no_earlier_one_sent() -> None:
    from bench.gpu.goodput_workloads import WORKLOADS, fresh_prompts, make_requests

    sent = make_requests(WORKLOADS["tiny"][2], 12, 0, 4096)
    a, b = fresh_prompts(sent, "pd:chat_mix:0:0", 4096), fresh_prompts(sent, "pd:chat_mix:0:1", 4096)
    assert [r.input_len for r in a] == [len(r.prompt) for r in a] == [r.input_len for r in sent]
    assert [(r.output_len, r.timeout_s) for r in a] == [(r.output_len, r.timeout_s) for r in sent]
    firsts = {tuple(r.prompt[:4]) for r in [*sent, *a, *b]}
    assert len(firsts) == 36  # no two prompts share a page-sized prefix to hit in a cache
    assert a == fresh_prompts(sent, "pd:chat_mix:0:0", 4096)  # the same salt, the same prompts


def test_the_ladder_sharpens_the_knee_before_probing_further_past_it() -> None:
    """A first miss not yet well below the target is bracketed before any higher rate is tried:
    a run out of time keeps the goodput found rather than points past the knee."""

    def attained(rate: float) -> float:  # holds to 40, then falls gently
        return 1.0 if rate <= 40 else max(0.0, 1.0 - 0.6 * (rate - 40) / 40)

    done: list[plan.Measured] = []
    while (rate := plan.next_rate(plan.Ladder(max_points=8), done)) is not None:
        done.append(plan.Measured(rate, attained(rate), attained(rate)))
    rates = [m.rate for m in done]
    assert rates[:5] == [4, 8, 16, 32, 64]  # 64 misses (82%), not well below
    assert rates[5] == 45.3 and max(rates[5:7]) < 64  # then the bracket (32, 64), not 83
    assert any(m.rate > 64 and m.loose < 0.6 for m in done)  # and past the knee after that
