"""Charts of GPU results: the goals from bench/gpu/perf.py's JSON (each ratio beside its goal),
the skinny-GEMM bandwidth from bench/gpu/gemv_perf.py's JSON (ours vs cuBLAS per shape), or the
speculative speedup against batch size from bench/gpu/spec_speedup.py's merged JSON.

Run: `python -m bench.gpu.plot bench/results/gpu_perf_h100.json` (writes the .png beside it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (label, value from the report, goal, True when higher is better)
GOALS = [
    ("decode bs1\n/ roofline", lambda r: r["decode_bs1"]["fraction_of_roofline"], 0.85, True),
    ("decode bs64 1K\n/ roofline", lambda r: r["decode_bs64_ctx1k"]["fraction_of_roofline"], 0.70, True),
    ("prefill 4K\n/ matmul rate", lambda r: r["prefill_4k"]["fraction_of_matmul_rate"], 0.60, True),
    ("verify (4 drafts)\n/ decode", lambda r: r["verify_bs1_4drafts"]["verify_chain_over_decode"], 1.15, False),
    ("GPU idle\nbs64 overlap", lambda r: r["engine_bs64_overlap_on"]["profiled"]["gpu_idle_fraction"], 0.05, False),
]


def plot_gemv(report: dict, out: Path) -> Path:
    """Fraction of copy bandwidth per projection, cuBLAS vs ours, at 1 and 5 activation rows."""
    names = ["qkv", "o", "gate_up", "down", "lm_head"]
    series = [
        (f"{who} m={m}", [report["shapes"][f"{n}_m{m}"][key] for n in names])
        for m in (1, 5)
        for who, key in (("cuBLAS", "cublas"), ("ours", "default"))
    ]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series):
        ax.bar([i + (j - 1.5) * width for i in range(len(names))], values, width, label=label)
    ax.axhline(1.0, color="black", linestyle="dashed", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("weight bytes / time / copy bandwidth")
    chain = report.get("chain", {})
    ax.set_title(
        f"{report['device']}: 8B decode GEMMs; 32-layer chain "
        f"{chain.get('cublas', {}).get('fraction', 0):.2f} cuBLAS -> "
        f"{chain.get('gemv_pdl', {}).get('fraction', 0):.2f} ours + PDL",
        fontsize=10,
    )
    ax.legend(ncol=4, fontsize=8, loc="lower center")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def plot_spec(report: dict, out: Path) -> Path:
    """Speedup over plain decoding against batch size: one panel per (model, draft acceptance p),
    a line per fixed step count and one for adaptive; plain is the dashed 1.0."""
    models = sorted({p["model"] for p in report["points"]}, reverse=True)
    accepts = sorted({p["p"] for p in report["points"]})
    fig, axes = plt.subplots(
        len(models), len(accepts), figsize=(4 * len(accepts), 3.2 * len(models)), squeeze=False, sharex=True
    )
    for row, model in enumerate(models):
        for col, acc in enumerate(accepts):
            ax, pts = axes[row][col], [p for p in report["points"] if p["model"] == model and p["p"] == acc]
            batches = [p["batch"] for p in pts]
            for steps in sorted(pts[0]["fixed_tok_s"], key=int):
                ax.plot(
                    batches,
                    [p["fixed_tok_s"][steps] / p["plain_tok_s"] for p in pts],
                    marker=".",
                    linewidth=1,
                    label=f"{steps} steps",
                )
            ax.plot(
                batches,
                [p["adaptive_tok_s"] / p["plain_tok_s"] for p in pts],
                marker="o",
                color="black",
                linewidth=2,
                label="adaptive",
            )
            ax.axhline(1.0, color="gray", linestyle="dashed", linewidth=1, label="plain")
            ax.set_xscale("log", base=2)
            ax.set_title(
                f"{model}, p={acc} (accept {pts[0]['accept_len']:.1f}-{pts[-1]['accept_len']:.1f})", fontsize=9
            )
            ax.set_xlabel("batch size")
            if col == 0:
                ax.set_ylabel("speedup over plain")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{report['device']}: EAGLE chain speedup, random weights, synthetic acceptance", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(path: str) -> Path:
    report = json.loads(Path(path).read_text())
    if "shapes" in report:
        return plot_gemv(report, Path(path).with_suffix(".png"))
    if "points" in report:
        return plot_spec(report, Path(path).with_suffix(".png"))
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (_label, get, goal, higher) in enumerate(GOALS):
        value = get(report)
        met = value >= goal if higher else value <= goal
        ax.bar(i, value, color="tab:green" if met else "tab:red", width=0.6)
        ax.hlines(goal, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
        ax.text(i, value + 0.02, f"{value:.3f}", ha="center")
    ax.set_xticks(range(len(GOALS)), [g[0] for g in GOALS])
    ax.set_ylabel("ratio (dashed: goal)")
    ax.set_title(
        f"{report['device']}: Llama-3.1-8B-shaped, bf16; vs HF generate "
        f"{report.get('vs_hf_generate_bs1', 0):.1f}x, overlap gain "
        f"{report.get('overlap_throughput_gain', 0):.2f}x"
    )
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1]))
