"""KV write bandwidth GPU 0 -> GPU 1 (bench/gpu/kv_bandwidth.py) on an idle sender, then while the
sender runs prefill-sized GEMMs (a 2,048-token batch through an 8B MLP projection, back to back),
as a prefill node's GPU does while it writes the previous prompt's KV.

Run: `python -m bench.gpu.kv_write_load --out OUT` on a two-GPU kind; writes
`OUT/kv_write_load_<gpu>.json` as {"device", "idle": {...}, "under_gemm_load": {...}}, each
kv_bandwidth.measure's report per prompt length (1,024 and 2,048 tokens, handoff rows beside the KV).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path

import torch

from bench.common import short_name, write_report

TOKENS = (1024, 2048)
LOAD_S = 90.0  # the load outlives the measurement under it (about 20 s on two H100s)
LOAD_SHAPE = (2048, 4096, 14336)  # tokens x hidden -> MLP width: a prefill batch's largest GEMM


def _gemm_load(stop_at: float) -> None:
    """Back-to-back bf16 GEMMs on GPU 0 until `stop_at` (a separate process, as a node is)."""
    torch.cuda.set_device(0)
    m, k, n = LOAD_SHAPE
    a = torch.randn(m, k, device="cuda:0", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda:0", dtype=torch.bfloat16)
    while time.time() < stop_at:
        for _ in range(50):
            a @ w
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    from bench.gpu.kv_bandwidth import measure

    out: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    out["idle"] = measure("cuda:0", "cuda:1", TOKENS, "kv")
    load = mp.get_context("spawn").Process(target=_gemm_load, args=(time.time() + LOAD_S,), daemon=True)
    load.start()
    try:
        time.sleep(5)  # the load's CUDA context and first GEMMs
        out["under_gemm_load"] = measure("cuda:0", "cuda:1", TOKENS, "kv")
    finally:
        load.kill()
    write_report(args.out / f"kv_write_load_{short_name(str(out['device']))}.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
