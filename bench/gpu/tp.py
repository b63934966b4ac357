"""Tensor parallelism on two GPUs: TP 2 against TP 1 on the Llama-3.1-8B shape, in one run.

Measures, per TP size, through the engine (graphs and overlap on): the batch-1 decode step, a
4,096-token prefill, batch-64 decode throughput with rank 0's kernel time per batch-64 step by
kind (all-reduce, attention, matmul, other), then EAGLE's batch-1 decode (an echo head on the
predictable checkpoint: nearly every draft accepted) for its speedup over plain at each TP size;
then the all-reduce latency of batch 1's and batch 64's hidden states (8 and 512 KiB, inside
a CUDA graph as the decode graphs run them), NCCL's and PyTorch's one-shot kernel's (which halves
NCCL's latency alone but lost inside the engine, with its staging copy, so the engine keeps NCCL:
bench/RESULTS.md), and TP 2's step against its roofline: half the weights read per GPU at the
measured copy bandwidth plus the all-reduces measured alone. Writes bench/results/tp_<gpu>.json.

  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m bench.gpu.tp --out bench/results --checkpoint /tmp/llama8b
  python -m bench.gpu.tp --tiny --out /tmp/tp   # the same code on a tiny model on the CPU (gloo)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.common import write_report
from bench.gpu.engine_perf import kernel_us_by_kind, steady_decode
from bench.gpu.hw import copy_bandwidth, time_cuda
from bench.gpu.spec_speedup import release_memory
from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from engine.parallel.group import NO_MULTICAST_ENV

GOALS = {
    "decode_bs1_ratio_max": 0.6,
    "prefill_4k_ratio_max": 0.6,
    "decode_bs64_speedup_min": 1.6,
    "roofline_min": 0.85,
    "eagle_speedup_kept_min": 0.9,  # EAGLE's speedup over plain at TP 2, over the same at TP 1
}
ALLREDUCES_PER_STEP = 2  # per decoder layer: after attention's o_proj and the MLP's down_proj


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(n)]


PREFILL_REPEATS = 3  # timed prompts (the median): one sample read TP 2's 4K prefill at 67 ms, then 109


def _prefill_ms(eng: Engine, length: int) -> float:
    """Median wall time of fresh `length`-token prompts (distinct: none hits the prefix cache)."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = _prompts(1 + PREFILL_REPEATS, length, eng.model_config.vocab_size, seed=1)
    eng.generate(prompts[:1], params)  # warm-up: the kernels' first launch and autotuning
    times = []
    for prompt in prompts[1:]:
        _sync()
        t0 = time.perf_counter()
        eng.generate([prompt], params)
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _config(model: Path, tp: int, device: str, tiny: bool) -> EngineConfig:
    prefill = 64 if tiny else 4096
    return EngineConfig(
        str(model),
        device=device,
        dtype="float32" if tiny else "bfloat16",
        tp_size=tp,
        attention_backend="torch" if tiny else "triton",  # the graph-safe kernels the nodes run on GPUs
        overlap=not tiny,
        cuda_graph_max_bs=0 if tiny else 64,
        max_running=64,
        chunked_prefill_size=2 * prefill,
        max_total_tokens=4096 if tiny else None,
        mem_fraction_static=0.85,
    )


def measure_engine(model: Path, tp: int, device: str, tiny: bool) -> dict[str, Any]:
    prefill, steps = (64, 8) if tiny else (4096, 64)
    eng = Engine(_config(model, tp, device, tiny))
    try:
        return {
            "tp": tp,
            "decode_bs1": steady_decode(eng, 1, 32 if tiny else 128, steps, None),
            "prefill_ms": _prefill_ms(eng, prefill),
            "prefill_tokens": prefill,
            "decode_bs64": steady_decode(eng, 8 if tiny else 64, 32 if tiny else 128, steps, None),
            **({} if tiny else {"decode_bs64_kernel_us": _kernel_split(eng, 64)}),
        }
    finally:
        eng.close()
        del eng  # the next engine sizes its KV cache from the memory this one held
        release_memory()


def _kernel_split(eng: Engine, bs: int, steps: int = 16) -> dict[str, float]:
    """One more profiled pass of the batch-`bs` decode: this rank's kernel microseconds per step by
    kind (all-reduce, attention, matmul, other) and the step's span, to tell where a TP step goes."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        r = steady_decode(eng, bs, 128, steps, trace)
        split = kernel_us_by_kind(trace, steps)
    return {**split, "step_us": r["step_ms"] * 1e3, "gpu_idle_fraction": r.get("gpu_idle_fraction") or 0.0}


def measure_eagle(model: Path, head: Path, tp: int, device: str, tiny: bool) -> dict[str, Any]:
    """EAGLE (3 steps, a chain)'s batch-1 decode: tokens/s and step time per iteration."""
    from spec.config import SpecConfig
    from spec.registry import bind

    eng = Engine(_config(model, tp, device, tiny), algorithm=bind(SpecConfig("EAGLE", str(head), 3, 1, None)))
    try:
        out = steady_decode(eng, 1, 32 if tiny else 128, 8 if tiny else 64, None)
        stats = eng.executor.spec_stats()
        out["accept_length"] = stats.mean_accept_len if stats is not None else None
        return out
    finally:
        eng.close()
        del eng  # the next engine sizes its KV cache from the memory this one held
        release_memory()


def echo_head(model: Path, out: Path, tiny: bool) -> Path:
    from fixtures.tiny_eagle import write_tiny_eagle_head

    inter = 128 if tiny else 14336  # a draft layer of the target's width
    return write_tiny_eagle_head(out, model, "eagle", mode="echo", intermediate_size=inter)


def allreduce_us(nbytes: int, tp: int) -> dict[str, Any] | None:
    """All-reduce of `nbytes` (bf16) on `tp` GPUs, replayed from a CUDA graph of 64 of them, by
    NCCL and by PyTorch's one-shot all-reduce over symmetric (CUDA IPC) buffers: on the buffer
    itself, staged from another tensor, and with that copy fused into the kernel
    (`one_shot_all_reduce_copy`); None without enough GPUs."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < tp:
        return None
    ctx = torch.multiprocessing.get_context("spawn")
    result = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_allreduce_rank, args=(r, tp, init, nbytes, result)) for r in range(tp)]
    for p in procs:
        p.start()
    times = result.get(timeout=300)
    for p in procs:
        p.join(60)
    return dict(times)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _allreduce_rank(rank: int, tp: int, init: str, nbytes: int, result: Any) -> None:
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=tp)
    times: dict[str, Any] = {"nccl_us": _graphed_us(lambda x: dist.all_reduce(x), nbytes)}
    try:  # the IPC one-shot kernel: every rank reads every peer's buffer directly
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        buf = symm_mem.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group)
        ops = torch.ops.symm_mem
        times["one_shot_us"] = _graphed_us(lambda _: ops.one_shot_all_reduce(buf, "sum", group), nbytes)
        # as an engine must use it, from a tensor of its own: staged (a copy into the symmetric
        # buffer, then the kernel: what lost in the engine), and with the copy inside the kernel
        times["one_shot_staged_us"] = _graphed_us(lambda x: ops.one_shot_all_reduce(buf.copy_(x), "sum", group), nbytes)
        times["one_shot_copy_us"] = _graphed_us(lambda x: ops.one_shot_all_reduce_copy(buf, x, "sum", group), nbytes)
    except Exception as e:  # noqa: BLE001 - recorded: a torch or driver without it
        times["one_shot_error"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        result.put(times)
    dist.barrier()
    dist.destroy_process_group()


def _graphed_us(op: Callable[[torch.Tensor], object], nbytes: int, n: int = 64) -> float:
    """Microseconds per `op`, from a CUDA graph holding `n` of them back to back."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        op(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            op(x)
    return time_cuda(graph.replay, iters=20) / n * 1e6


def roofline(model: Path, tp2: dict[str, Any], allreduce: dict[str, Any] | None, device: str) -> dict[str, Any]:
    """TP 2's batch-1 step against reading half the weights at the copy bandwidth plus the
    step's all-reduces measured alone."""
    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(model)
    per_layer = 4 * cfg.hidden_size * cfg.num_heads * cfg.head_dim  # q, o and (GQA-sized) k, v below
    per_layer += (
        2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim - 2 * cfg.hidden_size * cfg.num_heads * cfg.head_dim
    )
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    weights = (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size) * 2  # bf16; the head once
    bw = copy_bandwidth(torch.device(device)) if device.startswith("cuda") else None
    ar_us = allreduce.get("nccl_us") if allreduce else None
    if bw is None or ar_us is None:
        return {"weights_bytes": weights}
    floor_ms = weights / 2 / bw * 1e3 + ALLREDUCES_PER_STEP * cfg.num_layers * ar_us / 1e3  # NCCL's
    step = tp2["decode_bs1"]["step_ms"]
    return {"weights_bytes": weights, "copy_bandwidth": bw, "floor_ms": floor_ms, "ratio": floor_ms / step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/pdserve-llama8b"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU over gloo (the code path)")
    args = ap.parse_args()
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)
    if args.tiny:
        from fixtures.tiny_model import write_tiny_model

        model, device, gpu = write_tiny_model(args.out / "tiny-model", seed=1), "cpu", "cpu"
        device_name = "cpu"
    else:
        from bench.gpu.goodput_model import write_llama8b_dir

        model, device = write_llama8b_dir(args.checkpoint), "cuda:0"
        from bench.common import short_name

        device_name = torch.cuda.get_device_name(0)
        gpu = short_name(device_name)
    runs: dict[Any, dict[str, Any]] = {tp: measure_engine(model, tp, device, args.tiny) for tp in (1, 2)}
    head = echo_head(model, Path(tempfile.mkdtemp(prefix="pdserve-tp-eagle-")), args.tiny)
    for tp in (1, 2):
        runs[tp]["eagle_bs1"] = measure_eagle(model, head, tp, device, args.tiny)
    ar = allreduce_us(2 * 4096, 2) if not args.tiny else None
    ar64 = allreduce_us(64 * 2 * 4096, 2) if not args.tiny else None  # batch 64's hidden states
    one, two = runs[1], runs[2]
    speedup = {tp: runs[tp]["eagle_bs1"]["tokens_per_s"] / runs[tp]["decode_bs1"]["tokens_per_s"] for tp in (1, 2)}
    ratios = {
        "decode_bs1_ratio": two["decode_bs1"]["step_ms"] / one["decode_bs1"]["step_ms"],
        "prefill_4k_ratio": two["prefill_ms"] / one["prefill_ms"],
        "decode_bs64_speedup": two["decode_bs64"]["tokens_per_s"] / one["decode_bs64"]["tokens_per_s"],
        "eagle_speedup_tp1": speedup[1],
        "eagle_speedup_tp2": speedup[2],
        "eagle_speedup_kept": speedup[2] / speedup[1],
    }
    report = {
        "device": device_name,
        "model": "tiny (CPU code path)" if args.tiny else "Llama-3.1-8B shape, random bf16 weights, vocab 4096",
        "runs": runs,
        "allreduce_8KiB": ar,
        "allreduce_512KiB": ar64,
        "roofline": roofline(model, two, ar, device),
        "ratios": ratios,
        "goals": GOALS,
    }
    path = args.out / f"tp_{gpu}.json"
    write_report(path, report)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
