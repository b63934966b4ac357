"""`pdserve bench`: metric math on synthetic records, SSE parsing on a scripted stream with a fake
clock, the client against an in-process fake OpenAI server, and one short run against `pdserve up`."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI  # module level: FastAPI resolves the string annotations here

from fixtures.fake_openai import add_generation_routes, serving, sse

from loadgen.client import EndpointConfig, make_client, request_body, send
from loadgen.runner import BenchOptions, run_bench
from loadgen.dataset import CHARS_PER_TOKEN, BenchRequest, cut_prompt, random_requests, sample_lengths
from loadgen.metrics import RequestRecord, goodput, meets_slo, parse_slo, percentile, slo_attainment, summarize
from loadgen.sweep import LoadPoint, arrival_times, format_summary, parse_loads, run_point

REPO = Path(__file__).resolve().parent.parent


# ---- metric math -------------------------------------------------------------------------------


def _rec(i: int, ttft: float, chunks: list[float], e2e: float, tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        i, 10, tokens, start=0.0, ttft=ttft, chunk_times=chunks, e2e=e2e, output_tokens=tokens, error=error
    )


def test_percentile_interpolates_like_numpy() -> None:
    vals = [4.0, 1.0, 3.0, 2.0]
    assert percentile(vals, 50) == 2.5 and percentile(vals, 0) == 1.0 and percentile(vals, 100) == 4.0
    assert percentile(vals, 90) == pytest.approx(3.7) and percentile([7.0], 99) == 7.0


def test_summary_metrics_exact() -> None:
    recs = [
        _rec(0, 0.1, [0.1, 0.2, 0.3, 0.5], 0.5, 5),  # 4 chunks, 5 tokens (usage): TPOT 0.4/4
        _rec(1, 0.3, [0.3, 0.4], 0.4, 2),  # TPOT 0.1
        _rec(2, 0.2, [0.2], 0.2, 1),  # one token: no TPOT, no ITL
        RequestRecord(3, 10, 5, error="HTTP 500: boom"),
    ]
    m = summarize(recs, duration_s=2.0, slo=parse_slo("ttft=250ms,tpot=0.09s"))
    assert (m["completed"], m["failed"], m["errors"]) == (3, 1, {"HTTP 500: boom": 1})
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.0
    assert m["ttft_ms"]["mean"] == pytest.approx(200) and m["ttft_ms"]["median"] == pytest.approx(200)
    assert m["ttft_ms"]["p90"] == pytest.approx(280) and m["ttft_ms"]["p99"] == pytest.approx(298)
    assert m["tpot_ms"]["n"] == 2 and m["tpot_ms"]["mean"] == pytest.approx(100)  # (100 + 100) / 2
    itl = sorted(m["itl_ms"].items())
    assert m["itl_ms"]["n"] == 4 and m["itl_ms"]["mean"] == pytest.approx(125)  # 100,100,200,100
    assert m["itl_ms"]["max"] == pytest.approx(200), itl
    assert m["e2e_ms"]["median"] == pytest.approx(400)
    # SLO: rec 0 (TTFT 100 ms, TPOT 100 ms > 90) fails tpot; rec 1 fails ttft; rec 2 passes; rec 3 failed.
    assert m["good_requests"] == 1 and m["good_throughput"] == 0.5 and m["slo_attainment"] == 0.25
    assert slo_attainment(recs, parse_slo("ttft=250ms,tpot=0.09s")) == 0.25 and slo_attainment([], {}) == 0.0


def test_goodput_is_the_highest_swept_rate_with_90_percent_attainment() -> None:
    assert goodput([(1.0, 1.0), (2.0, 0.95), (4.0, 0.5), (8.0, 0.1)]) == 2.0
    assert goodput([(1.0, 0.9)]) == 1.0  # the bound itself counts
    assert goodput([(1.0, 0.89), (2.0, 0.2)]) is None
    assert goodput([(1.0, 1.0), (2.0, 0.8), (3.0, 0.92)]) == 3.0  # as swept, not the first miss
    assert goodput([(1.0, 1.0), (math.inf, 1.0)]) == 1.0  # everything at once is not a rate
    assert goodput([(1.0, 0.6), (2.0, 0.5)], min_attainment=0.5) == 2.0


def test_slo_parsing_and_vacuous_limits() -> None:
    assert parse_slo("ttft=500ms, tpot=50, e2e=2s,itl=800us") == pytest.approx(
        {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0, "itl": 0.0008}
    )
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("ttft", "foo=1ms", "ttft=fast", "ttft=1h"):
        with pytest.raises(ValueError, match="bad SLO"):
            parse_slo(bad)
    one = _rec(0, 0.1, [0.1], 0.1, 1)
    assert meets_slo(one, {"tpot": 0.001, "itl": 0.001}) and not meets_slo(one, {"ttft": 0.05})
    assert not meets_slo(RequestRecord(1, 1, 1, error="x"), {})
    assert summarize([], 0.0)["request_throughput"] == 0.0


# ---- loads and dataset -------------------------------------------------------------------------


def test_loads_and_poisson_arrivals() -> None:
    assert [p.label for p in parse_loads("1,2,inf", None)] == ["1", "2", "inf"]
    assert parse_loads(None, "1,4")[1] == LoadPoint("concurrency", 4.0)
    assert parse_loads(None, None) == [LoadPoint("rate", math.inf)]
    for rate, conc in (("1", "2"), ("0", None), (None, "inf"), (None, "1.5"), ("x", None)):
        with pytest.raises(ValueError):
            parse_loads(rate, conc)
    times = arrival_times(2000, 4.0, seed=3)
    assert times == arrival_times(2000, 4.0, seed=3) and times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]


class _WordTokenizer:
    """One token per whitespace-separated word: enough to check the cut."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_dataset_lengths_and_prompts() -> None:
    corpus = "def f(x):\n    return x + 1\n" * 50
    reqs = random_requests(20, 16, 8, range_ratio=0.5, seed=1, corpus=corpus)
    assert reqs == random_requests(20, 16, 8, range_ratio=0.5, seed=1, corpus=corpus)
    assert all(8 <= r.input_len <= 16 and 4 <= r.output_len <= 8 for r in reqs)
    assert all(len(r.prompt) == r.input_len * CHARS_PER_TOKEN for r in reqs)
    assert sample_lengths(__import__("random").Random(0), 5, 7, 0.0) == [7] * 5
    assert len(cut_prompt(corpus, len(corpus) - 3, 10, _WordTokenizer()).split()) == 10  # wraps
    real = random_requests(2, 32, 4, seed=0)  # the stdlib corpus itself
    assert all(len(r.prompt) == 32 * CHARS_PER_TOKEN for r in real)


# ---- SSE parsing with a scripted stream and a fake clock ---------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stream_timings_exact_with_fake_clock() -> None:
    clock = FakeClock()
    # (seconds that pass before the event, event): role-only delta, 3 content chunks, usage.
    script = [
        (0.05, {"choices": [{"delta": {"role": "assistant"}}]}),
        (0.10, {"choices": [{"delta": {"content": "a"}}]}),
        (0.02, {"choices": [{"delta": {"content": "bc"}}]}),
        (0.03, {"choices": [{"delta": {"content": "d"}, "finish_reason": "length"}]}),
        (0.01, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}),
    ]

    async def body() -> AsyncIterator[bytes]:
        for dt, event in script:
            clock.now += dt
            yield sse(event)
        yield b"data: [DONE]\n\n"

    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    cfg = EndpointConfig("http://fake", "m", endpoint="chat")
    rec = asyncio.run(_send_mock(handler, cfg, BenchRequest(0, "hi", 7, 4), clock))
    assert rec.ok, rec.error
    assert rec.ttft == pytest.approx(0.15) and rec.e2e == pytest.approx(0.21)
    assert rec.itls() == pytest.approx([0.02, 0.03]) and rec.output_tokens == 4 and rec.prompt_tokens == 7
    assert rec.tpot() == pytest.approx(0.02)  # (0.21 - 0.15) / 3
    body_sent = seen[0]
    assert body_sent["messages"][0]["content"] == "hi" and body_sent["ignore_eos"] is True
    assert body_sent["stream_options"] == {"include_usage": True} and body_sent["max_tokens"] == 4


async def _send_mock(handler: Any, cfg: EndpointConfig, req: BenchRequest, clock: FakeClock) -> RequestRecord:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=cfg.base_url) as client:
        return await send(client, cfg, req, t0=clock(), clock=clock)


def test_request_body_options() -> None:
    cfg = EndpointConfig("http://x", "m", ignore_eos=False, include_usage=False, extra_body={"top_k": 1})
    body = request_body(cfg, "p", 3)
    assert body["prompt"] == "p" and "ignore_eos" not in body and "stream_options" not in body
    assert body["top_k"] == 1 and body["stream"] is True
    with pytest.raises(ValueError):
        EndpointConfig("http://x", "m", endpoint="embeddings")
    assert request_body(cfg, [5, 6, 7], 3)["prompt"] == [5, 6, 7]  # token ids go as they are
    with pytest.raises(ValueError, match="completions endpoint"):
        request_body(EndpointConfig("http://x", "m", endpoint="chat"), [5, 6], 3)


# ---- the client against an in-process fake OpenAI server ---------------------------------------

CHUNK_DELAY_S = 0.01


def _fake_app() -> Any:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        n = int(body["max_tokens"])
        for i in range(n):
            await asyncio.sleep(CHUNK_DELAY_S)
            if n == 14 and i == 2:  # an error event in the middle of the stream
                yield sse({"error": {"message": "node died", "code": 500}})
                return
            choice = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            yield sse({"choices": [{"index": 0, **choice}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}})
        yield b"data: [DONE]\n\n"

    add_generation_routes(app, stream)
    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    with serving(_fake_app()) as url:
        yield url


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_against_fake_server(fake_server: str, endpoint: str) -> None:
    cfg = EndpointConfig(fake_server, "fake-model", endpoint=endpoint, timeout_s=10)
    reqs = [BenchRequest(i, f"prompt {i}", 5, n) for i, n in enumerate([4, 13, 6, 14])]

    async def go() -> tuple[list[RequestRecord], float]:
        async with httpx.AsyncClient(base_url=fake_server, timeout=10) as client:
            return await run_point(client, cfg, reqs, LoadPoint("concurrency", 2))

    records, wall = asyncio.run(go())
    ok = {r.index: r for r in records if r.ok}
    assert sorted(ok) == [0, 2] and [r.output_tokens for r in ok.values()] == [4, 6]
    for r in ok.values():
        assert r.ttft >= CHUNK_DELAY_S and len(r.itls()) == r.output_tokens - 1 and r.e2e >= r.ttft
        assert r.prompt_tokens == 5
    assert records[1].error.startswith("HTTP 503") and "no capacity" in records[1].error
    assert records[3].error == "stream error: node died"
    m = summarize(records, wall)
    assert (m["completed"], m["failed"]) == (2, 2) and m["output_throughput"] > 0


def test_refused_connection_and_timeout_are_records(fake_server: str) -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = EndpointConfig(dead, "m", timeout_s=2, connect_timeout_s=1)
    slow = EndpointConfig(fake_server, "m", timeout_s=0.05)

    async def go() -> list[RequestRecord]:
        async with make_client(cfg, 1) as c1, make_client(slow, 1) as c2:
            a = await send(c1, cfg, BenchRequest(0, "p", 1, 2), t0=time.perf_counter())
            b = await send(c2, slow, BenchRequest(1, "p", 1, 50), t0=time.perf_counter())
            own = BenchRequest(2, "p", 1, 50, timeout_s=0.03)  # its own limit wins over the endpoint's
            c = await send(c2, EndpointConfig(fake_server, "m", timeout_s=10), own, t0=time.perf_counter())
            return [a, b, c]

    refused, timed_out, own_limit = asyncio.run(go())
    assert refused.error and refused.error.startswith("ConnectError")
    assert timed_out.error == "timeout after 0.05 s" and own_limit.error == "timeout after 0.03 s"


def test_run_bench_end_to_end_on_fake_server(fake_server: str, tmp_path: Path) -> None:
    opts = BenchOptions(
        base_url=fake_server,
        num_prompts=4,
        input_len=8,
        output_len=6,
        range_ratio=0.0,
        request_rate="50,inf",
        warmup=1,
        slo="ttft=5s,tpot=1s",
        out=tmp_path,
        usage=False,
    )
    report, files = run_bench(opts, progress=False)
    assert [f.name for f in files] == ["results.json", "latency.png", "throughput.png"]
    assert json.loads((tmp_path / "results.json").read_text()) == report
    assert report["config"]["endpoint"]["model"] == "fake-model" and report["config"]["warmup"]["failed"] == 0
    assert [p["load"]["value"] for p in report["points"]] == [50, "inf"]
    for p in report["points"]:
        m = p["metrics"]
        assert m["completed"] == 4 and m["total_output_tokens"] == 24
        assert m["good_throughput"] == m["request_throughput"] and m["slo_attainment"] == 1.0
        assert len(p["requests"]) == 4 and all(r["output_tokens"] == 6 for r in p["requests"])
    assert report["goodput"] == {"req_s": 50, "min_attainment": 0.9}  # inf is not a rate
    assert "goodput (highest rate with >= 90% of requests within the SLO): 50 req/s" in format_summary(report)
    assert all(f.stat().st_size > 10_000 for f in files[1:])


def test_cli_imports_stay_light() -> None:
    import subprocess

    code = (
        "import sys, loadgen.runner; "
        "print(sorted(m for m in ('torch', 'engine', 'httpx', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


# ---- against a live `pdserve up` (router + prefill + decode processes) -------------------------


@pytest.mark.slow
def test_bench_serving_against_live_pdserve_up(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    from engine.kv_transfer import nixl_available

    if not nixl_available():
        pytest.skip("nixl-cu13 is not installed (pdserve up needs it)")
    from bench.serving import main

    model = str(tiny_llama_dir)  # a unique tmp path: it names exactly this deployment's nodes
    monkeypatch.chdir(REPO)  # the nodes run `python -m pdserve.cli` from the working directory
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 3 torch processes on 2 cores
    out = tmp_path / "out"
    start = time.monotonic()
    try:
        code = main(
            [
                "--up",
                "--up-model",
                model,
                "--tokenizer",
                model,
                "--num-prompts",
                "5",
                "--input-len",
                "24",
                "--output-len",
                "6",
                "--range-ratio",
                "0",
                "--request-rate",
                "20",
                "--warmup",
                "1",
                "--slo",
                "ttft=10s",
                "--no-progress",
                "--out",
                str(out),
            ],
            up_timeout_s=120,
        )
    finally:
        left = subprocess.run(["pgrep", "-f", model], capture_output=True, text=True, timeout=10).stdout.split()
        for pid in left:  # Deployment.stop should have taken them down; never leave any behind
            subprocess.run(["kill", "-9", pid], timeout=10, check=False)
    assert code == 0 and not left, left
    assert time.monotonic() - start < 180
    report = json.loads((out / "results.json").read_text())
    (point,) = report["points"]
    m = point["metrics"]
    assert m["completed"] == 5 and m["failed"] == 0 and m["total_output_tokens"] == 5 * 6  # ignore_eos
    assert m["ttft_ms"]["p99"] >= m["ttft_ms"]["median"] > 0 and m["good_throughput"] > 0
    for r in point["requests"]:
        assert r["output_tokens"] == 6 and abs(r["prompt_tokens"] - 24) <= 3  # cut with the tokenizer
    assert (out / "latency.png").stat().st_size > 10_000 and (out / "throughput.png").stat().st_size > 10_000
