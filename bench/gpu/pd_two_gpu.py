"""PD across two GPUs of one host: a prefill node on GPU 0, a decode node on GPU 1 and a router,
NIXL moving KV device to device (CUDA IPC over NVLink), against a colocated node on GPU 0.

The model has the Llama-3.1-8B KV shape (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB of KV
per token) with a narrow body (hidden 1024, MLP 2816) so the run fits a short GPU slot; the KV
moved per token is the 8B model's. EAGLE (3-step chains, a head that predicts the target's own
features) decodes in both deployments.

Reports (OUT/pd_two_gpu_<gpu>.json):
* bandwidth: KV + handoff row per request for 1K and 8K-token prompts through the transport, and
  raw NIXL GPU0 -> GPU1 in the same run (bench/gpu/kv_bandwidth.py); goal: ratio >= 0.8;
* outputs: a fixed greedy request set through the router, PD texts == colocated texts;
* acceptance: the decode node's mean accepted length == the colocated node's;
* TTFT: PD minus colocated time to first token (1-token requests one at a time, 21 per prompt
  length after 3 warm-ups, medians over two passes; each request's TTFT is the change of the
  router's TTFT sum across it, so a first token that reaches the client before the request ends
  counts then; `e2e_*`: the whole request at the client) for both prompt lengths, against the
  full KV's transfer time + 2 ms. The deployments run one at a time, each alone on the GPUs and
  each twice in turn (three node processes sharing GPU 0 made one prompt's forward differ between
  them by more than the transfer takes). A single prompt's forward still varies between requests
  by more than the transfer takes, so each request's own forward (the change of its node's
  prompt-time sum) is taken out of its TTFT too: `beyond_forward_ms` is the median of those
  per-request remainders, and `diff_beyond_forward_ms` PD's minus colocated's (what the handoff
  adds). Each deployment's time is also split by stage from the router's and the nodes'
  histograms. Chunked prefill (2K-token chunks) sends each chunk's pages while the next one runs,
  so the handoff adds about one chunk's transfer. Two more PD deployments: one writes each
  prompt's KV in one write at the end (--no-kv-send-chunks), to show what chunk pipelining
  changes; one posts every write as one scatter-gather list (--kv-write-sgl on).

Handoff rows live beside the KV as nodes keep them by default (`rows=host` as an argument: in
host memory, `--kv-handoff-rows host`); the bandwidth probe uses the same placement and also
reports the other one.

With one GPU the same runs put both nodes on it (NIXL within VRAM), and the report says
"one GPU". Run: `python -m bench.gpu.pd_two_gpu OUT [rows=kv|host]` (keep NVLink multicast off:
NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

from bench.common import short_name, write_report
from bench.gpu import kv_bandwidth
from bench.serving_matrix import scrape_accept_len
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from pdserve.up import Deployment, UpConfig

CHUNK = 2048
NODE_ARGS = (
    "--page-size",
    str(kv_bandwidth.PAGE),
    "--max-total-tokens",
    "40000",
    "--chunked-prefill-size",
    str(CHUNK),
    "--max-running",
    "16",
    "--metrics-port",
    "0",
    "--speculative-algorithm",
    "EAGLE",
    "--speculative-num-steps",
    "3",
)
ROUNDS, WARMUP = 21, 3
PASSES = 2  # each deployment started this many times, in turn with the others
DEPLOYMENTS = (("colocated", 1), ("pd", 0), ("pd_whole_prompt_write", 0), ("pd_sgl", 0))  # (name, colocated nodes)
# flags of the PD variants, as environment variables (they reach only the nodes that have the flag)
DEPLOYMENT_ENV = {
    "pd_whole_prompt_write": {"PDSERVE_KV_SEND_CHUNKS": "false"},
    "pd_sgl": {"PDSERVE_KV_WRITE_SGL": "on"},
}
FIXED_SET = [(n, seed) for n, seed in ((24, 1), (100, 2), (300, 3), (700, 4), (1500, 5), (3000, 6))]


def write_models(root: Path) -> tuple[Path, Path]:
    target = write_tiny_model(
        root / "target",
        seed=0,
        hidden_size=1024,
        num_layers=kv_bandwidth.LAYERS,
        num_heads=8,
        num_kv_heads=kv_bandwidth.KV_HEADS,
        head_dim=kv_bandwidth.HEAD_DIM,
        intermediate_size=2816,
        max_position_embeddings=16384,
        dtype="bfloat16",
    )
    return target, write_tiny_eagle_head(root / "head", target, "eagle", mode="repeat")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def complete(url: str, ids: list[int], max_tokens: int) -> tuple[str, float]:
    body = json.dumps(
        {"model": _model(url), "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        text = json.load(r)["choices"][0]["text"]
    return text, time.perf_counter() - t0


def _model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def warm_up(urls: dict[str, str], tokens: int) -> None:
    """Warm the shapes (kernels, allocator) of this length in every deployment."""
    for url in urls.values():
        for i in range(WARMUP):
            complete(url, prompt(tokens, 90 + i), 1)


def ttft_samples(dep: Deployment, url: str, tokens: int) -> dict[str, list[float]]:
    """ROUNDS one-token requests, one at a time: each one's time to first token as the router saw
    it, its prompt forward on the node that ran it and the host time that node spent launching the
    prompt's chunks (from the changes of the router's TTFT sum and the node's prompt-time and
    launch-time sums across the request; the first token may reach the client before the request
    ends: a PD router relays the prefill's token before the decode adopts the request), and its
    whole latency at the client (ms)."""
    out: dict[str, list[float]] = {"ttft": [], "forward": [], "launch": [], "e2e": []}
    for i in range(ROUNDS):
        before = scrape_sums(dep)
        out["e2e"].append(complete(url, prompt(tokens, 100 + i), 1)[1] * 1e3)
        for key, ms in request_times_ms(before, scrape_sums(dep)).items():
            out[key].append(ms)
    return out


# (series, label) of a request's times: the router's TTFT, the node's prompt time and its prompt
# chunks' launches
REQUEST_SERIES = {
    "ttft": ("router:pdserve_router_time_to_first_token_seconds", ""),
    "forward": ("pdserve_node_prompt_seconds", ""),
    "launch": ("pdserve_node_launch_seconds", 'kind="prompt"'),
}


def request_times_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """{ttft, forward, launch} (ms) of the one request between two scrapes: each series' sum
    change, over every key of it that has the label (the router's endpoints, say)."""

    def delta(series: str, label: str) -> float:
        keys = [k for k in after if series in k and label in k]
        return sum(after[k][0] - before.get(k, (0.0, 0.0))[0] for k in keys) * 1e3

    return {name: delta(*series) for name, series in REQUEST_SERIES.items()}


# Where PD's time to first token goes: the router's stages and the prefill's write timings.
STAGE_SERIES = (
    "pdserve_router_time_to_first_token_seconds",
    "pdserve_router_ttft_stage_seconds",
    "pdserve_node_launch_seconds",
    "pdserve_kv_transfer_seconds",
    "pdserve_kv_handoff_tail_seconds",
    "pdserve_kv_handoff_stage_seconds",
    "pdserve_node_queue_time_seconds",
    "pdserve_node_prompt_seconds",
)


def scrape_sums(dep: Deployment) -> dict[str, tuple[float, float]]:
    """{series{labels}: (sum, count)} of the stage histograms over the router and every node."""
    out: dict[str, tuple[float, float]] = {}
    for child in dep.children:
        port = child.ports.get("metrics") or (child.ports.get("http") if child.name == "router" else None)
        if port is None:
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            out.update(stage_sums(child.name, r.read().decode()))
    return out


def stage_sums(source: str, text: str) -> dict[str, tuple[float, float]]:
    """{source:series{labels}: (sum, count)} of the stage histograms in one /metrics text."""
    out: dict[str, tuple[float, float]] = {}
    for m in re.finditer(r"^(\w+)_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M):
        if m.group(1) in STAGE_SERIES:
            key = f"{source}:{m.group(1)}{m.group(3) or ''}"
            s, c = out.get(key, (0.0, 0.0))
            out[key] = (s + float(m.group(4)), c) if m.group(2) == "sum" else (s, c + float(m.group(4)))
    return out


def stage_means_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean milliseconds per observation of each series between two scrapes."""
    means = {}
    for key, (s, c) in after.items():
        s0, c0 = before.get(key, (0.0, 0.0))
        if c > c0:
            means[key] = (s - s0) / (c - c0) * 1e3
    return means


def serve(target: Path, head: Path, colocated: int, device: str = "cuda") -> Deployment:
    args = (*NODE_ARGS, "--speculative-draft-model-path", str(head))
    return Deployment(
        UpConfig(
            str(target),
            port=0,
            device=device,
            colocated=colocated,
            node_args=args,
            start_timeout_s=300,
            isolate_gpus=False,
        )
    )


def measure_deployment(name: str, dep: Deployment, rows: str) -> dict[str, Any]:
    """Start one deployment alone, run the fixed set, then per prompt length the TTFT samples and
    the stage means over exactly those requests; stop it."""
    # the rows' place on prefill and decode, and the variant's own prefill flags
    env = {"PDSERVE_KV_HANDOFF_ROWS": rows, **DEPLOYMENT_ENV.get(name, {})}
    try:
        with mock.patch.dict(os.environ, env):
            url = dep.start(lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True))
        out: dict[str, Any] = {
            "texts": [complete(url, prompt(n, seed), 32)[0] for n, seed in FIXED_SET],
            "accept_len": scrape_accept_len(dep),
            "ttft": {},
        }
        for t in kv_bandwidth.TOKENS:
            for i in range(WARMUP):  # the shapes of this length: kernels, allocator
                complete(url, prompt(t, 90 + i), 1)
            before = scrape_sums(dep)
            samples = ttft_samples(dep, url, t)
            stages = stage_means_ms(before, scrape_sums(dep))
            out["ttft"][str(t)] = {
                "ms": statistics.median(samples["ttft"]),
                "stages_ms": stages,
                "samples_ms": samples["ttft"],
                "e2e_samples_ms": samples["e2e"],
                "forward_samples_ms": samples["forward"],
                "launch_samples_ms": samples["launch"],
            }
        return out
    finally:
        dep.stop()


def pooled(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """One deployment's passes as one: texts and acceptance must agree between passes (else the
    first pass's are kept and the mismatch shows in `texts_equal_between_passes`), TTFT samples
    pooled, stage means averaged."""
    first = passes[0]
    out: dict[str, Any] = {
        "texts": first["texts"],
        "accept_len": first["accept_len"],
        "ttft": {},
        "texts_equal_between_passes": all(p["texts"] == first["texts"] for p in passes),
    }
    for t in first["ttft"]:
        rows = [p["ttft"][t] for p in passes]
        pool = lambda key: [x for r in rows for x in r[key]]  # noqa: E731
        samples, e2e, forward = pool("samples_ms"), pool("e2e_samples_ms"), pool("forward_samples_ms")
        launch = pool("launch_samples_ms")
        beyond = [a - f for a, f in zip(samples, forward)]  # per request: what is not the forward
        stages = {k: statistics.fmean(r["stages_ms"].get(k, 0.0) for r in rows) for k in rows[0]["stages_ms"]}
        out["ttft"][t] = {
            "ms": statistics.median(samples),
            "samples_ms": samples,
            "stages_ms": stages,
            "e2e_ms": statistics.median(e2e),
            "e2e_samples_ms": e2e,
            "prompt_forward_ms": statistics.median(forward),
            "forward_samples_ms": forward,
            "beyond_forward_ms": statistics.median(beyond),
            # host time launching the prompt's chunks: near the forward = launch-bound
            "prompt_launch_ms": statistics.median(launch),
            "launch_samples_ms": launch,
            "pass_medians_ms": [r["ms"] for r in rows],
        }
    return out


def ttft_report(runs: dict[str, dict[str, Any]], bandwidth: dict[str, Any]) -> dict[str, Any]:
    """Per prompt length: each PD variant's median TTFT against colocated's, and the same
    difference net of each deployment's own prompt forward, against the transfer + 2 ms."""
    ttft: dict[str, Any] = {}
    for t in (str(n) for n in kv_bandwidth.TOKENS):
        col = runs["colocated"]["ttft"][t]
        full = bandwidth[t]["ours_s"] * 1e3
        row: dict[str, Any] = {
            "colocated_ms": col["ms"],
            "colocated_prompt_forward_ms": col["prompt_forward_ms"],
            "colocated_beyond_forward_ms": col["beyond_forward_ms"],
            "full_transfer_ms": full,
            "chunk_transfer_ms": full * min(1.0, CHUNK / int(t)),
        }
        for name in (n for n in runs if n != "colocated"):
            pd = runs[name]["ttft"][t]
            diff = pd["ms"] - col["ms"]
            beyond = pd["beyond_forward_ms"] - col["beyond_forward_ms"]
            row[name] = {
                "ms": pd["ms"],
                "diff_ms": diff,
                "within_transfer_plus_2ms": diff <= full + 2.0,
                "e2e_diff_ms": pd["e2e_ms"] - col["e2e_ms"],
                "prompt_forward_ms": pd["prompt_forward_ms"],
                "beyond_forward_ms": pd["beyond_forward_ms"],
                "diff_beyond_forward_ms": beyond,
                "beyond_forward_within_transfer_plus_2ms": beyond <= full + 2.0,
            }
        row["stages_ms"] = {name: r["ttft"][t]["stages_ms"] for name, r in runs.items()}
        row["samples_ms"] = {name: r["ttft"][t]["samples_ms"] for name, r in runs.items()}
        for key in ("forward_samples_ms", "launch_samples_ms"):
            row[key] = {name: r["ttft"][t][key] for name, r in runs.items()}
        row["prompt_launch_ms"] = {name: r["ttft"][t]["prompt_launch_ms"] for name, r in runs.items()}
        ttft[t] = row
    return ttft


def main() -> int:
    import torch

    args = sys.argv[1:]
    rows = next((a.split("=", 1)[1] for a in args if a.startswith("rows=")), "kv")
    rest = [a for a in args if not a.startswith("rows=")]
    out = Path(rest[0] if rest else "bench/results")
    gpus = torch.cuda.device_count()
    topology = "two GPUs" if gpus >= 2 else "one GPU"
    src, dst = "cuda:0", "cuda:1" if gpus >= 2 else "cuda:0"
    bandwidth = kv_bandwidth.measure(src, dst, rows_device="kv" if rows == "kv" else "cpu")
    other_rows = kv_bandwidth.measure(src, dst, rows_device="cpu" if rows == "kv" else "kv")
    with tempfile.TemporaryDirectory() as tmp:
        target, head = write_models(Path(tmp))
        passes: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in DEPLOYMENTS}
        for _ in range(PASSES):  # whole passes in turn: a node process's own speed averages out
            for name, colocated in DEPLOYMENTS:
                passes[name].append(measure_deployment(name, serve(target, head, colocated), rows))
        runs = {name: pooled(p) for name, p in passes.items()}
    ttft = ttft_report(runs, bandwidth)
    report = {
        "device": torch.cuda.get_device_name(),
        "topology": topology,
        "gpus": gpus,
        "command": "python -m bench.gpu.pd_two_gpu OUT" + ("" if rows == "kv" else f" rows={rows}"),
        "chunked_prefill_size": CHUNK,
        "handoff_rows": rows,
        "bandwidth": bandwidth,
        "bandwidth_goal_met": all(b["ratio_vs_raw"] >= 0.8 for b in bandwidth.values()),
        "bandwidth_goal_met_sgl": all(b["ratio_sgl_vs_raw"] >= 0.8 for b in bandwidth.values()),
        "bandwidth_other_rows": other_rows,
        "pd_equals_colocated": all(r["texts"] == runs["colocated"]["texts"] for r in runs.values()),
        "accept_len": {name: r["accept_len"] for name, r in runs.items()},
        "acceptance_equal": len({r["accept_len"] for r in runs.values()}) == 1,
        "texts_equal_between_passes": all(r["texts_equal_between_passes"] for r in runs.values()),
        "ttft": ttft,
        "texts": {k: v["texts"] for k, v in runs.items()},
    }
    gpu = short_name(report["device"])
    write_report(out / f"pd_two_gpu_{gpu}.json", report)
    brief = {
        t: {k: v for k, v in row.items() if not k.endswith(("samples_ms", "stages_ms"))} for t, row in ttft.items()
    }
    print(
        json.dumps(
            {
                **{
                    k: report[k]
                    for k in (
                        "topology",
                        "bandwidth_goal_met",
                        "bandwidth_goal_met_sgl",
                        "pd_equals_colocated",
                        "accept_len",
                    )
                },
                "ttft": brief,
            },
            indent=1,
        )
    )
    return 0 if report["pd_equals_colocated"] and report["acceptance_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
