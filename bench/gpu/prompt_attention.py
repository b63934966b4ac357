"""Prompt attention kernels side by side on the 8B shape (32 query heads, 8 kv heads, dim 128,
bf16, causal): the paged extend kernel, the prompt kernel over contiguous own keys (a sweep of
tile settings), and torch's SDPA backends. Each case's TFLOP/s counts causal FLOPs only, and its
largest difference from torch's math attention is recorded. Calls are timed as CUDA graph
replays (host launches would dominate the few-microsecond cases).

`python -m bench.gpu.prompt_attention --out OUT/prompt_attention.json` (GPU machine).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from bench.common import write_report
from bench.gpu.hw import graphed, time_cuda
from engine.attention.triton_backend import extend_config
from engine.attention.triton_kernels.common import TileConfig
from engine.attention.triton_kernels.extend import extend_attention
from engine.attention.triton_kernels.prompt import prompt_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
# tile settings tried on an H200 (bench/RESULTS.md); 64 x 64, 4 warps, 3 stages is the default
SWEEP = [
    TileConfig(64, 64, 4, 3),
    TileConfig(64, 64, 4, 2),
    TileConfig(64, 32, 4, 3),
    TileConfig(128, 64, 8, 3),
    TileConfig(128, 128, 8, 3),
    TileConfig(128, 64, 4, 3),
]


class Case:
    """Packed requests of (prefix, chunk) tokens: q/k/v of the chunks, the prefix in a paged pool
    with pages in shuffled order."""

    def __init__(self, shape: list[tuple[int, int]], dev: torch.device) -> None:
        g = torch.Generator(device=dev).manual_seed(0)
        self.shape = shape
        total = sum(p + e for p, e in shape)
        pages = -(-total // PAGE) + len(shape)
        tokens = sum(e for _, e in shape)
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, device=dev, dtype=torch.bfloat16, generator=g)
        self.q = qkv[:, : HEADS * DIM].view(tokens, HEADS, DIM)
        self.k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
        self.v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
        self.k_cache = torch.randn(pages * PAGE, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        self.v_cache = torch.randn_like(self.k_cache)
        order = torch.randperm(pages, device=dev, generator=g)
        width = max(p + e for p, e in shape)
        self.req_to_token = torch.zeros(len(shape), -(-width // PAGE) * PAGE, dtype=torch.int32, device=dev)
        first = 0
        starts, lens = [0], []
        for i, (p, e) in enumerate(shape):
            n = -(-(p + e) // PAGE)
            slots = (order[first : first + n, None] * PAGE + torch.arange(PAGE, device=dev)).flatten()[: p + e]
            self.req_to_token[i, : p + e] = slots.to(torch.int32)
            rows = slice(starts[-1], starts[-1] + e)
            self.k_cache[slots[p:]] = self.k[rows]
            self.v_cache[slots[p:]] = self.v[rows]
            first += n
            starts.append(starts[-1] + e)
            lens.append(p + e)
        self.qo_indptr = torch.tensor(starts, dtype=torch.int32, device=dev)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.extend_lens = torch.tensor([e for _, e in shape], dtype=torch.int32, device=dev)
        self.slots = torch.arange(len(shape), dtype=torch.int32, device=dev)
        self.max_extend = max(e for _, e in shape)
        self.scale = 1 / math.sqrt(DIM)
        self.out = torch.empty_like(self.q)

    def flops(self) -> float:
        # per query token: QK^T and PV over the keys it sees (prefix + causal part of its chunk)
        seen = sum(e * p + e * (e + 1) / 2 for p, e in self.shape)
        return 4 * seen * HEADS * DIM

    def paged(self) -> torch.Tensor:
        return extend_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.req_to_token,
            self.slots,
            self.seq_lens,
            self.extend_lens,
            self.qo_indptr,
            self.max_extend,
            None,
            self.scale,
            extend_config(DIM, self.q.device),
            self.out,
        )

    def prompt(self, cfg: TileConfig) -> torch.Tensor:
        return prompt_attention(
            self.q,
            self.k,
            self.v,
            self.k_cache,
            self.v_cache,
            self.req_to_token,
            self.slots,
            self.seq_lens,
            self.extend_lens,
            self.qo_indptr,
            self.max_extend,
            self.scale,
            cfg,
            self.out,
        )

    def sdpa(self, backend: SDPBackend, expand: bool) -> torch.Tensor:
        """Fresh prompts only: one SDPA call per request over its own keys."""
        outs = []
        start = 0
        for _, e in self.shape:
            q, k, v = (t[start : start + e].transpose(0, 1).unsqueeze(0) for t in (self.q, self.k, self.v))
            if expand:
                k, v = (t.repeat_interleave(HEADS // KV_HEADS, 1) for t in (k, v))
            with sdpa_kernel(backend):
                o = scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=not expand)
            outs.append(o.squeeze(0).transpose(0, 1))
            start += e
        return torch.cat(outs)

    def reference(self) -> torch.Tensor:
        """fp32 math attention over each request's keys from the pool."""
        outs = []
        for i, (p, e) in enumerate(self.shape):
            slots = self.req_to_token[i, : p + e].long()
            k = self.k_cache[slots].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
            v = self.v_cache[slots].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
            start = int(self.qo_indptr[i])
            q = self.q[start : start + e].float().transpose(0, 1)
            mask = torch.arange(p + e, device=q.device)[None, :] <= (p + torch.arange(e, device=q.device))[:, None]
            o = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)


def measure(case: Case, fn: Callable[[], torch.Tensor], ref: torch.Tensor) -> dict[str, Any]:
    try:
        out = fn().float()
        secs = time_cuda(graphed(fn), iters=20)
    except Exception as e:  # noqa: BLE001 - a backend torch lacks is a finding, not a crash
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    return {
        "ms": round(secs * 1e3, 4),
        "tflops": round(case.flops() / secs / 1e12, 1),
        "max_abs_diff": round((out - ref).abs().max().item(), 4),
    }


def run_case(shape: list[tuple[int, int]], dev: torch.device) -> dict[str, Any]:
    case = Case(shape, dev)
    ref = case.reference()
    res: dict[str, Any] = {"shape": shape, "tflop": case.flops() / 1e12, "paged_extend": measure(case, case.paged, ref)}
    for cfg in SWEEP:
        name = f"prompt_m{cfg.block_m}_n{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
        res[name] = measure(case, lambda cfg=cfg: case.prompt(cfg), ref)
    if all(p == 0 for p, _ in shape):
        backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
        backends["efficient"] = SDPBackend.EFFICIENT_ATTENTION
        for name, backend in backends.items():
            for expand in (False, True):
                key = f"sdpa_{name}{'_expanded' if expand else '_gqa'}"
                res[key] = measure(case, lambda b=backend, x=expand: case.sdpa(b, x), ref)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prompt_attention.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    shapes = {
        "fresh_4096": [(0, 4096)],
        "fresh_2048": [(0, 2048)],
        "chunk_2048_over_2048": [(2048, 2048)],
        "four_fresh_1024": [(0, 1024)] * 4,
        "follow_up_200_over_2000": [(2000, 200)],
        "four_100_over_1000": [(1000, 100)] * 4,
        "tail_16_over_2000": [(2000, 16)],
    }
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": {}}
    for name, shape in shapes.items():
        t0 = time.perf_counter()
        report["cases"][name] = run_case(shape, dev)
        print(f"[{time.perf_counter() - t0:5.1f}s] {name}: {report['cases'][name]}", flush=True)
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
