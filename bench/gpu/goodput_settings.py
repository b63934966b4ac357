"""The goodput benchmark's settings: its command line, the sweep's sizes and SLOs, the deployments
to measure and each PD run's TPOT guard (bench/gpu/goodput.py runs them)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from bench.gpu import goodput_plan as plan
from bench.gpu.goodput_run import RunSettings
from bench.gpu.goodput_up import TOPOLOGIES
from common.defaults import SGL_MODES
from loadgen.metrics import parse_slo

SLOS = {"loose": "ttft=500ms,tpot=25ms", "tight": "ttft=250ms,tpot=15ms"}
# (window_s, least, most requests per point, points per curve, budget_s) by model and --quick
SIZES = {
    # 8 points: the tight knee gets sharpened too. Up to 480 requests, 6 s of arrivals up to 80
    # req/s: at 200, chat_mix's knees near 90 req/s on two H200s were 2.2-s bursts, and a curve
    # read 50% at 34.9 and 82% at 38.1 req/s (bench/RESULTS.md, twenty-third run).
    ("llama8b", False): (6.0, 24, 480, 8, 540.0),
    ("llama8b", True): (4.0, 16, 120, 4, 300.0),
    ("tiny", False): (3.0, 8, 24, 5, 240.0),
    ("tiny", True): (2.0, 6, 12, 3, 90.0),
}
START_RATE = {"llama8b": 4.0, "tiny": 4.0}  # requests/s


# one deployment's start (a guess until one is measured) and stop, seconds
def stream_interval_arg(text: str) -> int | str:
    """`--stream-interval`: auto, or a token count >= 1 (kept an int: reports compare it as one)."""
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"auto or a token count >= 1, not {text!r}")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.goodput", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the JSON and PNG")
    p.add_argument("--model", choices=("auto", "llama8b", "tiny"), default="auto", help="auto: llama8b on GPUs")
    p.add_argument("--model-dir", type=Path, help="where the checkpoint is (written there when missing)")
    p.add_argument("--quick", action="store_true", help="fewer, shorter points and a shorter budget")
    p.add_argument("--workloads", default=None, help="comma-separated subset (default: all three)")
    p.add_argument(
        "--deployments",
        default="pd,colocated",
        help="comma-separated, measured in this order: pd (the router picks each prompt's node), "
        "colocated, pd_remote (every prompt on the prefill node), pd_pooled (pd with --pd-pooling auto), "
        "pd_always_pooled (pd with --pd-pooling always); "
        "a PD one with @loose or @tight runs with its guard set from that SLO and is judged by it alone "
        "(e.g. pd_pooled@tight,pd_pooled@loose,colocated)",
    )
    p.add_argument("--max-running", type=int, default=None, help="the nodes' --max-running (default: theirs)")
    p.add_argument(
        "--local-prefill-tpot-ms",
        type=float,
        default=None,
        help="PD decode nodes' TPOT guard for the prompts they run (default: 0.8 x the tight SLO's TPOT, "
        "0.9 x while they mix their chunks into decode steps, the default, so their running requests keep "
        "within both SLOs)",
    )
    p.add_argument(
        "--guard-share",
        type=float,
        default=None,
        help="PD decode nodes' TPOT guard as a share of the TPOT limit it is set from (default 0.9, 0.8 "
        "with --disable-mixed-chunk); --local-prefill-tpot-ms, where given, sets the guard of a plain run",
    )
    p.add_argument("--disable-mixed-chunk", action="store_true", help="the nodes' --disable-mixed-chunk")
    p.add_argument("--pd-mixed-remote-ttft-target-ms", type=float, default=None, help="PD routers' flag of that name")
    p.add_argument(
        "--whole-on-prefill",
        action="store_true",
        help="PD's prefill nodes run requests whole when the decode node is at its TPOT budget "
        "(their --local-decode-tpot-ms, at the decode nodes' guard)",
    )
    p.add_argument("--kv-write-sgl", choices=SGL_MODES, default=None, help="the prefill nodes' --kv-write-sgl")
    p.add_argument("--switch-interval-ms", type=float, default=None, help="every node's --switch-interval-ms")
    p.add_argument(
        "--stream-interval",
        type=stream_interval_arg,
        default=None,
        help="every node's --stream-interval, N or auto (default: theirs, auto; 1 before the "
        "twenty-ninth run): tokens per streamed message after the first, fewer messages for the "
        "router's one event loop to relay",
    )
    p.add_argument(
        "--prompt-graph-tokens",
        type=int,
        default=None,
        help="every node's --cuda-graph-prompt-tokens (default: theirs, 2048; 512 was the default before "
        "the twenty-sixth run)",
    )
    p.add_argument("--eagle", action="store_true", help="EAGLE with an echo draft head in both deployments")
    p.add_argument("--device", default="auto", help="pdserve up --device")
    p.add_argument("--budget-s", type=float, default=None, help="whole run's time budget in seconds")
    p.add_argument("--start-rate", type=float, default=None, help="first rate of every curve (req/s)")
    p.add_argument("--max-points", type=int, default=None, help="most rates per curve")
    p.add_argument(
        "--resolution",
        type=float,
        default=None,
        help="the ratio below which a knee's bracket is left as it is (default: the ladder's 1.25); "
        "1.1 tells a 1.2x goodput ratio from one rung's noise, at a point or two more per curve",
    )
    p.add_argument(
        "--redraws",
        type=int,
        default=None,
        help="second Poisson draws per curve at rates whose first is doubtful (85-95%% attainment) or out "
        "of order (default 3; 0 with --quick)",
    )
    p.add_argument(
        "--around",
        type=Path,
        default=None,
        help="an earlier goodput JSON: each curve is measured at the rungs next to the knees it found "
        "(each rung once, further rungs where they do not bracket the knee, then --focus-draws of each), "
        "not up the ladder from --start-rate; a curve it found no knee for takes the ladder",
    )
    p.add_argument(
        "--around-from",
        default="",
        help="with --around: comma-separated deployments whose knees a curve takes where the earlier "
        "report has none of its own, first found first (e.g. colocated for pd_always_pooled)",
    )
    p.add_argument("--focus-draws", type=int, default=2, help="with --around: Poisson draws of every rung")
    p.add_argument("--focus-step", type=float, default=1.1, help="with --around: ratio between rungs")
    p.add_argument("--slo-loose", default=SLOS["loose"])
    p.add_argument("--slo-tight", default=SLOS["tight"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None, help="pdserve up logs (default: a temporary folder)")
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="an earlier call's goodput JSON on this machine, same settings: its points join this run's "
        "(a comparison longer than one call's time limit); a deployment run may return for workloads it "
        "has not measured (bench/gpu/goodput_resume.py also merges reports after the calls)",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="with --resume: drop the earlier call's points of the deployment runs this call measures "
        "on the workloads it measures, instead of refusing them (a run cut short, or measured before a "
        "fix); the report lists them",
    )
    return p.parse_args(argv)


def run_settings(args: argparse.Namespace, kind: str) -> tuple[RunSettings, float]:
    """The sweep's settings (sizes by model and --quick, flags over them) and the time budget."""
    window, least, most, points, budget = SIZES[(kind, args.quick)]
    slos = {"loose": parse_slo(args.slo_loose), "tight": parse_slo(args.slo_tight)}
    for name, slo in slos.items():
        if set(slo) != {"ttft", "tpot"}:
            raise SystemExit(f"the {name} SLO needs a ttft and a tpot limit, and only those")
    ladder = plan.Ladder(start=args.start_rate or START_RATE[kind], max_points=args.max_points or points)
    if args.redraws is not None or args.quick:  # a smoke run draws each rate once
        ladder = replace(ladder, max_redraws=max(0, args.redraws or 0))
    if args.guard_share is not None and not 0 < args.guard_share <= 1:
        raise SystemExit(f"--guard-share must be in (0, 1], got {args.guard_share}")
    if args.resolution is not None:
        if args.resolution <= 1.0:
            raise SystemExit(f"--resolution must be above 1, got {args.resolution}")
        ladder = replace(ladder, resolution=args.resolution)
    settings = RunSettings(ladder, window, least, most, slos, args.seed, vocab=0)
    return with_focus(args, settings), args.budget_s or budget


def with_focus(args: argparse.Namespace, settings: RunSettings) -> RunSettings:
    """`--around`: the earlier report whose knees the curves are measured around, and its rungs."""
    if args.around is None:
        return settings
    if args.focus_draws < 1 or args.focus_step <= 1.0:
        raise SystemExit(
            f"--focus-draws must be >= 1 and --focus-step above 1, got {args.focus_draws}, {args.focus_step}"
        )
    try:
        prior = json.loads(args.around.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--around {args.around}: {e}") from None
    if prior.get("slos") != {n: {f"{k}_ms": v * 1e3 for k, v in slo.items()} for n, slo in settings.slos.items()}:
        raise SystemExit(f"--around {args.around}: its SLOs differ from this run's")
    focus = plan.Focus((), step=args.focus_step, draws=args.focus_draws)
    around_from = tuple(d for d in args.around_from.split(",") if d)
    if unknown := [d for d in around_from if d not in TOPOLOGIES]:
        known = ", ".join(TOPOLOGIES)
        raise SystemExit(f"--around-from: unknown deployment(s) {', '.join(unknown)} (topologies {known})")
    return replace(settings, around=prior, focus=focus, around_from=around_from)


def parse_deployments(text: str) -> list[tuple[str, str | None]]:
    """`--deployments`: (topology, SLO its run is set up for and judged by, or None for both).
    `pd_pooled@loose` starts pd_pooled with its guards from the loose SLO and counts its points for
    that SLO only, as an operator would configure PD for the SLO it promises; a topology is given
    either plain or per SLO, and colocated nodes have no guard to set."""
    out: list[tuple[str, str | None]] = []
    for item in (d for d in text.split(",") if d):
        dep, _, judged = item.partition("@")
        if dep not in TOPOLOGIES or (judged and (judged not in SLOS or dep == "colocated")):
            raise ValueError(
                f"unknown deployment {item!r} (topologies {', '.join(TOPOLOGIES)}; PD ones may take @loose or @tight)"
            )
        out.append((dep, judged or None))
    for dep in {d for d, _ in out}:
        runs = [j for d, j in out if d == dep]
        if len(runs) != len(set(runs)) or (None in runs and len(runs) > 1):
            raise ValueError(f"{dep} is given twice, or both plain and per SLO, in {text!r}")
    if not out:
        raise ValueError("no deployment to measure")
    return out


def guard_for(args: argparse.Namespace, settings: RunSettings, judged: str | None) -> float:
    """The decode nodes' TPOT guard of a run: set from the one SLO it is judged by, else as
    `local_guard_ms` says."""
    if judged is None:
        return local_guard_ms(args, settings)
    return guard_share(args) * settings.slos[judged]["tpot"] * 1e3


def local_guard_ms(args: argparse.Namespace, settings: RunSettings) -> float:
    """The decode nodes' TPOT guard: given, or under the tighter SLO's TPOT with a fifth to spare
    (a guard at the SLO itself would spend all of it on requests that decode beside a prompt); a
    tenth with mixed chunks, where the guard holds every step rather than each request's mean."""
    if args.local_prefill_tpot_ms is not None:
        return float(args.local_prefill_tpot_ms)
    return guard_share(args) * min(slo["tpot"] for slo in settings.slos.values()) * 1e3


def guard_share(args: argparse.Namespace) -> float:
    """The guard's share of the TPOT limit it is set from: given, or a fifth to spare with chunks
    beside decode steps and a tenth with them inside (module docstring of bench/gpu/goodput.py)."""
    if args.guard_share is not None:
        return float(args.guard_share)
    return 0.8 if args.disable_mixed_chunk else 0.9
