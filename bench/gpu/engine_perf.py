"""Engine-level GPU measurements: decode throughput with overlap on/off, GPU idle time between steps
(from the profiler's kernel timeline), and tokens/s against HF transformers `generate`."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import engine.build as build_mod
from engine.config import ModelConfig
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig


@contextmanager
def prebuilt_model(model: nn.Module, cfg: ModelConfig) -> Iterator[None]:
    """Engine loads from a directory; hand it the in-memory random-weight model instead."""
    original = build_mod.load_model
    build_mod.load_model = lambda *a, **k: (model, cfg)  # type: ignore[assignment]
    try:
        yield
    finally:
        build_mod.load_model = original  # type: ignore[assignment]


def make_engine(
    model: nn.Module,
    cfg: ModelConfig,
    *,
    overlap: bool,
    graphs: int,
    max_running: int,
    max_total_tokens: int,
    backend: str = "triton",
    algorithm: Any = None,
    model_dir: str = "<in-memory llama-8b-shaped>",
    **extra: Any,
) -> Engine:
    """An engine over the in-memory model (`algorithm`: a spec binding, or None for plain;
    `model_dir`: where a tokenizer lies, for grammars, else a name that is never read)."""
    with prebuilt_model(model, cfg):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        conf = EngineConfig(
            model_dir,
            device=dev,
            dtype="bfloat16" if dev == "cuda" else "float32",
            max_running=max_running,
            max_total_tokens=max_total_tokens,
            chunked_prefill_size=8192,
            attention_backend=backend,
            max_context_len=4096,
            overlap=overlap,
            cuda_graph_max_bs=graphs,
            **extra,
        )
        return Engine(conf, algorithm=algorithm)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def busy_fraction(trace_file: Path) -> tuple[float, float]:
    """(busy seconds, span seconds) of the union of GPU kernel/memcpy intervals in a Chrome trace."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e
    )
    if not spans:
        return 0.0, 0.0
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / 1e6, (spans[-1][1] - spans[0][0]) / 1e6


# Kernel kinds by name (lower case), first match wins: the engine's Triton kernels and the libraries'.
KERNEL_KINDS = (
    ("all-reduce", ("nccl", "all_reduce", "allreduce")),
    (
        "attention",
        ("_split_kernel", "_merge_kernel", "_extend_kernel", "_prompt_kernel", "_store_kv_kernel", "attn", "flash"),
    ),
    ("matmul", ("gemm", "gemv", "_skinny_kernel", "cutlass", "xmma", "sm90", "cublas", "matmul")),
)


def kernel_kind(name: str) -> str:
    """A kernel's kind by its name (KERNEL_KINDS, first match), else "other"."""
    low = name.lower()
    return next((k for k, parts in KERNEL_KINDS if any(p in low for p in parts)), "other")


def kernel_us_by_kind(trace_file: Path, steps: int) -> dict[str, float]:
    """Device microseconds per step by kernel kind (KERNEL_KINDS, the rest as "other") in a Chrome
    trace: what a step's time is spent on, e.g. how much a tensor-parallel step waits in NCCL."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    out: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        kind = kernel_kind(str(e.get("name", "")))
        out[kind] = out.get(kind, 0.0) + e["dur"] / steps
    return out


def steady_decode(eng: Engine, bs: int, prompt_len: int, steps: int, trace: Path | None) -> dict[str, Any]:
    """Prefill `bs` prompts, then time `steps` engine steps of pure decode (profiled if `trace`)."""
    params = SamplingParams(max_new_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = eng.model_config.vocab_size
    rids = [eng.add_request(torch.randint(10, vocab, (prompt_len,), generator=gen).tolist(), params) for _ in range(bs)]
    started: set[str] = set()
    while len(started) < bs:  # prefill phase: until every request has its first token
        started.update(d.rid for d in eng.step() if d.token_ids)
    for _ in range(5):  # warm the decode path (graph capture on first use, if lazy)
        eng.step()
    _sync()
    tokens, t0 = 0, time.perf_counter()
    if trace is not None:
        from torch.profiler import ProfilerActivity, profile

        # device activity only: tracing CPU ops would slow the scheduler and inflate the gaps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tokens = sum(len(d.token_ids) for _ in range(steps) for d in eng.step())
            _sync()
        secs = time.perf_counter() - t0
        prof.export_chrome_trace(str(trace))
    else:
        tokens = sum(len(d.token_ids) for _ in range(steps) for d in eng.step())
        _sync()
        secs = time.perf_counter() - t0
    for rid in rids:
        eng.abort(rid)
    while not eng.idle:
        eng.step()
    out: dict[str, Any] = {
        "batch": bs,
        "prompt_len": prompt_len,
        "steps": steps,
        "tokens_per_s": tokens / secs,
        "step_ms": secs / steps * 1e3,
    }
    if trace is not None:
        busy, span = busy_fraction(trace)
        out.update(gpu_busy_s=busy, gpu_span_s=span, gpu_idle_fraction=1 - busy / span if span else None)
    return out


def engine_generate_tps(eng: Engine, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    eng.generate([prompt], params)  # warm-up (graphs, autotuning)
    _sync()
    t0 = time.perf_counter()
    out = eng.generate([prompt], params)
    _sync()
    return len(out[0].output_ids) / (time.perf_counter() - t0)


def hf_generate_tps(hf: nn.Module, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt], device=next(hf.parameters()).device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    hf.generate(ids, **dict(kw, max_new_tokens=8, min_new_tokens=8))  # warm-up
    _sync()
    t0 = time.perf_counter()
    out = hf.generate(ids, **kw)
    _sync()
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
