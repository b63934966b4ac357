"""Step-level ratios on a Llama-3.1-8B-shaped model: decode vs the bandwidth roofline, prefill vs the
matmul rate, verify vs decode. Every ceiling is measured in the same run (bench/gpu/hw.py)."""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu.hw import time_cuda
from bench.gpu.llama8b import matmul_params
from bench.gpu.rig import Rig, decode_step_fn, step_context
from engine.config import ModelConfig
from engine.core import ForwardMode
from engine.kv_budget import kv_bytes_per_token


def graph_counters(rig: Rig) -> dict[str, Any]:
    stats = rig.runner.graph_stats
    return {
        "hits": stats.hits,
        "captures": stats.captures,
        "eager": stats.eager,
        "eager_reasons": dict(stats.eager_reasons),
    }


def decode_roofline(
    rig: Rig, cfg: ModelConfig, bw: float, weight_bytes: int, bs: int, context: int, iters: int = 30
) -> dict[str, Any]:
    """Decode step time vs (weight bytes + KV bytes read) / copy bandwidth."""
    ids, ctx = step_context(rig, ForwardMode.DECODE, bs, context)
    secs = time_cuda(decode_step_fn(rig, ids, ctx), iters)
    kv_bytes = bs * context * kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2)  # bf16 K+V
    ideal = (weight_bytes + kv_bytes) / bw
    return {
        "batch": bs,
        "context": context,
        "step_ms": secs * 1e3,
        "roofline_ms": ideal * 1e3,
        "fraction_of_roofline": ideal / secs,
        "tokens_per_s": bs / secs,
        "weight_gb": weight_bytes / 1e9,
        "kv_gb": kv_bytes / 1e9,
    }


def verify_vs_decode(rig: Rig, bs: int, context: int, ntok: int, iters: int = 30) -> dict[str, Any]:
    """TARGET_VERIFY over `ntok` tokens per request (bonus + drafts) vs one plain decode step."""
    ids, ctx = step_context(rig, ForwardMode.DECODE, bs, context)
    dec = time_cuda(decode_step_fn(rig, ids, ctx), iters)
    out: dict[str, Any] = {"batch": bs, "context": context, "verify_tokens": ntok, "decode_ms": dec * 1e3}
    for tree in (False, True):
        ids, ctx = step_context(rig, ForwardMode.TARGET_VERIFY, bs, context, ntok, tree=tree)
        ver = time_cuda(decode_step_fn(rig, ids, ctx), iters)
        key = "tree" if tree else "chain"
        out[f"verify_{key}_ms"] = ver * 1e3
        out[f"verify_{key}_over_decode"] = ver / dec
    return out


def prefill_rate(
    rig: Rig, cfg: ModelConfig, mm_rate: float, tokens: int, iters: int = 5, held_rate: float | None = None
) -> dict[str, Any]:
    """A fresh prompt of `tokens` tokens (logits of the last one) vs the measured matmul rate: a
    short burst's (`mm_rate`, the goal's yardstick) and, if given, one held as long as this runs."""
    ids, ctx = step_context(rig, ForwardMode.EXTEND, 1, tokens, tokens)
    secs = time_cuda(decode_step_fn(rig, ids, ctx, logits_rows=slice(-1, None)), iters, warmup=2)
    attn = cfg.num_layers * 2 * tokens * tokens * cfg.num_heads * cfg.head_dim  # causal QK^T + PV
    flops = 2 * matmul_params(cfg) * tokens + attn + 2 * cfg.hidden_size * cfg.vocab_size
    out = {
        "tokens": tokens,
        "ms": secs * 1e3,
        "tflops": flops / secs / 1e12,
        "fraction_of_matmul_rate": flops / secs / mm_rate,
        "tokens_per_s": tokens / secs,
    }
    if held_rate:
        out["fraction_of_sustained_matmul_rate"] = flops / secs / held_rate
    return out


def eager_vs_graph(rig: Rig, bs: int, context: int, iters: int = 20) -> dict[str, Any]:
    """The same decode step with graphs off (eager) and on; also checks they agree."""
    ids, ctx = step_context(rig, ForwardMode.DECODE, bs, context)
    fn = decode_step_fn(rig, ids, ctx)
    graphs = rig.runner.graphs
    if graphs is None:
        return {"skipped": "graphs are off"}
    rig.runner.graphs = None
    eager_tok = fn()
    eager = time_cuda(fn, iters)
    rig.runner.graphs = graphs
    graph_tok = fn()
    graph = time_cuda(fn, iters)
    return {
        "batch": bs,
        "eager_ms": eager * 1e3,
        "graph_ms": graph * 1e3,
        "speedup": eager / graph,
        "same_tokens": bool(torch.equal(eager_tok, graph_tok)),
    }
