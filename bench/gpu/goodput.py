"""Goodput of PD 1P1D against two colocated replicas behind the same router, under Poisson load.

Deployments: `pd` (1P1D, the router choosing each prompt's node: the prefill node, or the decode
node between its decode steps), `colocated` (two replicas) and, on request, `pd_remote` (1P1D with
every prompt on the prefill node). Each is a real `pdserve up` (fast path on: Triton attention, CUDA graphs, overlap),
measured alone on the GPUs: start it, sweep every workload, stop it, start the other. For each
workload and deployment the Poisson rate is swept adaptively (bench/gpu/goodput_plan.py) and the
same runs are judged by two SLOs, loose (TTFT 500 ms, TPOT 25 ms) and tight (TTFT 250 ms,
TPOT 15 ms). Nodes run with their roles' defaults (a decode node batches up to 256 requests, a
colocated one 64); PD's decode node keeps its running requests within a TPOT guard of 0.9 x the
tight SLO's TPOT while it runs prompts inside its decode steps (`--local-prefill-tpot-ms`; 0.8 x
with `--disable-mixed-chunk`, when they run beside them). A PD deployment named per SLO
(`pd_pooled@tight,pd_pooled@loose`) is instead started once per SLO, its guard at 0.9 x that
SLO's TPOT (`--guard-share`), and each run's points count for its SLO alone: an operator sets the guard from the
TPOT it promises, and on two H100s a guard set for the tight SLO starved a pooled prefill node's
prompts at rates the loose SLO allows (bench/RESULTS.md, nineteenth and twentieth runs). Per point: attainment (the
share of requests meeting both limits; failed ones count as missing), TTFT and TPOT p50/p90/p99
over completed requests, requests/s and output tokens/s.

Goodput (loadgen/metrics.py, DistServe's definition) is the highest swept rate whose attainment
is at least 90%; under the loose SLO it is each deployment's "highest rate within the loose SLO"
(`highest_rate_within_loose_slo`). A request is cancelled once it can no longer meet the loose SLO
(as a client with a deadline would): overloaded points then end instead of draining a backlog,
and the next point starts on an idle deployment (the nodes' gauges are polled until empty).

Model: Llama-3.1-8B's shape, random bf16 weights made predictable (the next token a function of
the current one), the built-in tokenizer's 4,096-token vocabulary (bench/gpu/goodput_model.py),
plain decoding (`--eagle`: EAGLE with an echo head, which drafts that function and is nearly
always right on these weights; on the tiny model its drafts are mostly rejected). Prompts are token ids of exact
lengths (bench/gpu/goodput_workloads.py). On a CPU (`--model tiny`, the default without GPUs) a
tiny model and tiny lengths run the same code.

Writes OUT/goodput_<gpu>.json (with `goals`: PD over colocated per curve, and whether PD is at
least level on every curve, 1.3x under the tight SLO on two workloads and 1.2x the highest rate
within the loose SLO on every workload) and OUT/goodput_<gpu>.png after every curve; each deployment's
`pdserve up --verbose` log goes to LOG_DIR. Run on two GPUs (9-10 minutes; `--quick` about 5):
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    python -m bench.gpu.goodput --out bench/results
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from bench.common import short_name
from bench.gpu import goodput_plan as plan
from bench.gpu.goodput_report import GOODPUT_DEFINITION, Results, summary_text
from bench.gpu.goodput_resume import resume
from bench.gpu.goodput_run import RunSettings, measure_deployment
from bench.gpu.goodput_up import LABELS, UpProcess, node_env, up_argv
from bench.gpu.goodput_settings import (
    guard_for,
    guard_share,
    local_guard_ms,
    parse_args,
    parse_deployments,
    run_settings,
)
from bench.gpu.goodput_workloads import WORKLOADS, length_stats, make_requests, with_time_limits

START_GUESS_S = {"llama8b": 90.0, "tiny": 10.0}
STOP_S = {"llama8b": 15.0, "tiny": 5.0}
START_TIMEOUT_S = {"llama8b": 300.0, "tiny": 120.0}


def gpu_names() -> list[str]:
    """The GPUs nvidia-smi lists (none on a CPU host); the parent never touches CUDA itself."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def prepare_model(kind: str, model_dir: Path | None, eagle: bool) -> tuple[Path, list[str]]:
    """The checkpoint directory (written if needed) and the speculative flags for `pdserve up`."""
    root = model_dir or Path(tempfile.gettempdir()) / f"pdserve-goodput-{kind}"
    if kind == "llama8b":
        from bench.gpu.goodput_model import MARKER, write_llama8b_dir

        theirs = (root / "config.json").is_file() and not (root / MARKER).is_file()
        target = root if theirs else write_llama8b_dir(root)  # a checkpoint given with --model-dir: as it is
    else:
        from fixtures.tiny_model import write_tiny_model

        target = root if (root / "config.json").is_file() else write_tiny_model(root, num_heads=4, num_kv_heads=2)
    if not eagle:
        return target, []
    from fixtures.tiny_eagle import write_tiny_eagle_head

    inter = 14336 if kind == "llama8b" else 128  # a draft layer of the target's width
    head_dir = Path(tempfile.mkdtemp(prefix="pdserve-goodput-eagle-"))  # never inside a given checkpoint
    head = write_tiny_eagle_head(head_dir, target, "eagle", mode="echo", intermediate_size=inter)
    return target, ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(head)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a job's time limit) unwinds like Ctrl-C, so the deployment in flight is stopped
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The whole benchmark; returns the exit code (1: a deployment failed, its error is in the report)."""
    started = time.monotonic()
    gpus = gpu_names()
    kind = args.model if args.model != "auto" else ("llama8b" if gpus else "tiny")
    device = gpus[0] if gpus else "cpu"
    settings, budget_s = run_settings(args, kind)
    model, spec_flags = prepare_model(kind, args.model_dir, args.eagle)
    from common.tokenizer import Tokenizer  # torch-free

    vocab = Tokenizer.from_dir(model).vocab_size
    settings = replace(settings, vocab=vocab)
    chosen = args.workloads.split(",") if args.workloads else [w.name for w in WORKLOADS[kind]]
    workloads = [w for w in WORKLOADS[kind] if w.name in chosen]
    try:
        deployments = parse_deployments(args.deployments)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not workloads:
        raise SystemExit(f"unknown workloads {args.workloads!r}")
    cut = lambda n: plan.cut_after_s(settings.slos["loose"], n)  # noqa: E731
    requests = {w.name: with_time_limits(make_requests(w, settings.most, args.seed, vocab), cut) for w in workloads}
    results = Results(header(args, argv, device, gpus, kind, model, vocab, spec_flags, settings, budget_s))
    for w in workloads:
        results.workload(w.name, {"description": w.describe(), "sent": length_stats(requests[w.name])})
    if args.resume:
        resume(results, args.resume, deployments, args.remeasure, [w.name for w in workloads])
    budget = plan.Budget(started + budget_s, len(workloads), len(deployments), START_GUESS_S[kind], STOP_S[kind])
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-goodput-logs-"))
    failed, gpu = False, short_name(device)
    for dep, judged in deployments:
        guard_ms = f"{guard_for(args, settings, judged):g}"
        guard = ["--local-prefill-tpot-ms", guard_ms]  # decode nodes only
        if args.whole_on_prefill:  # prefill nodes only
            guard += ["--local-decode-tpot-ms", guard_ms]
        if args.pd_mixed_remote_ttft_target_ms is not None:  # `up` gives it to PD routers only
            guard += ["--pd-mixed-remote-ttft-target-ms", f"{args.pd_mixed_remote_ttft_target_ms:g}"]
        argv_up = up_argv(dep, model, [*spec_flags, *guard, "--device", args.device])
        name = f"{dep}@{judged}" if judged else dep
        log = log_dir / f"{name}.log"
        results.deployment(dep, {"label": LABELS[dep]})
        run_info = {"command": " ".join(argv_up[2:]), "log": str(log), "guard_ms": float(guard_ms)}
        results.deployment(dep, run_info, judged)
        env = node_env(
            args.max_running,
            not args.disable_mixed_chunk,
            args.kv_write_sgl,
            args.switch_interval_ms,
            args.prompt_graph_tokens,
            args.stream_interval,
        )
        t0 = time.monotonic()
        try:
            with UpProcess(dep, argv_up, env, log) as up:
                up.start(timeout_s=START_TIMEOUT_S[kind])
                budget.started(time.monotonic() - t0)
                results.deployment(dep, {"start_s": time.monotonic() - t0}, judged)
                print(f"[goodput] {name} up at {up.url} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
                measure_deployment(up, dep, workloads, requests, settings, budget, results, args.out, gpu, judged)
        except (RuntimeError, OSError, httpx.HTTPError) as e:  # one deployment failing leaves the other's results
            failed = True
            results.deployment(dep, {"error": str(e)[-2000:]}, judged)
            print(f"[goodput] {name} failed: {e}", file=sys.stderr, flush=True)
        budget.deployment_done()
    results.data["wall_s"] = time.monotonic() - started
    path, png = results.write(args.out, gpu)
    print(summary_text(results.data))
    print(f"plot: {png}" if png else "no plot (matplotlib is not installed)")
    return 1 if failed else 0


def header(
    args: argparse.Namespace,
    argv: list[str] | None,
    device: str,
    gpus: list[str],
    kind: str,
    model: Path,
    vocab: int,
    spec_flags: list[str],
    settings: RunSettings,
    budget_s: float,
) -> dict[str, Any]:
    """What the report says about the run before any point."""
    return {
        "device": device,
        "gpus": gpus,
        "command": "python -m bench.gpu.goodput " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": {"kind": kind, "dir": str(model), "vocab": vocab, "speculative": " ".join(spec_flags) or "none"},
        "slos": {name: {f"{k}_ms": v * 1e3 for k, v in slo.items()} for name, slo in settings.slos.items()},
        "goodput_definition": GOODPUT_DEFINITION,
        "settings": {
            "ladder": {**asdict(settings.ladder), "both_slos_extra_points": plan.BOTH_SLOS_EXTRA_POINTS},
            "window_s": settings.window_s,
            "requests_per_point": [settings.least, settings.most],
            "budget_s": budget_s,
            "max_running": args.max_running,
            "local_prefill_tpot_ms": local_guard_ms(args, settings),
            "guard_share": guard_share(args),
            "mixed_chunk": not args.disable_mixed_chunk,
            "whole_on_prefill": args.whole_on_prefill,
            "kv_write_sgl": args.kv_write_sgl,
            "switch_interval_ms": args.switch_interval_ms,
            "prompt_graph_tokens": args.prompt_graph_tokens,
            "stream_interval": args.stream_interval,
            "quick": args.quick,
            "seed": args.seed,
            "focus": focus_setting(settings),
        },
    }


def focus_setting(settings: RunSettings) -> dict[str, Any] | None:
    """`--around`'s run, as the report records it: the earlier run's command, the rungs' step and draws."""
    if settings.around is None:
        return None
    return {"around": settings.around.get("command"), "step": settings.focus.step, "draws": settings.focus.draws}


if __name__ == "__main__":
    sys.exit(main())
