"""The one-shot all-reduce over symmetric memory (engine/parallel/fast_allreduce.py) on two GPUs:
back-to-back sums of changing inputs through the one staging buffer, eager and replayed from a CUDA
graph, equal NCCL's; messages it cannot take go to NCCL."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

CALLS = 64  # as many as a decode step of the 8B shape runs


def _rank(rank: int, init: str, errors: mp.Queue) -> None:
    try:
        from engine.parallel.group import init_tp_group, leave_tp_group

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = init_tp_group(rank, 2, init, device, 60.0, allreduce="one-shot")
        assert group.one_shot is not None
        xs = [torch.full((4, 4096), float(rank + 1 + i), dtype=torch.bfloat16, device=device) for i in range(CALLS)]
        for i, x in enumerate(xs):  # eager: rank 0 holds i + 1, rank 1 i + 2
            group.all_reduce(x)
            assert bool((x == float(2 * i + 3)).all()), ("eager", i)
        ins = [torch.zeros(4, 4096, dtype=torch.bfloat16, device=device) for _ in range(CALLS)]
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for x in ins:
                group.all_reduce(x)
        for replay in range(3):  # new inputs each replay: the buffer is reused within and across them
            for i, x in enumerate(ins):
                x.fill_(float(rank + 1 + i + replay))
            graph.replay()
            torch.cuda.synchronize()
            for i, x in enumerate(ins):
                assert bool((x == float(2 * (i + replay) + 3)).all()), ("graph", replay, i)
        big = torch.ones(1 << 20, dtype=torch.bfloat16, device=device)  # 2 MiB: over the buffer, NCCL's
        assert not group.one_shot.fits(big)
        group.all_reduce(big)
        assert bool((big == 2.0).all())
        graph.reset()
        leave_tp_group(group, together=True)
    except BaseException as e:  # noqa: BLE001 - reported to the test process
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_one_shot_sums_equal_nccl_eager_and_in_graphs() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    errors: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, init, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found and all(p.exitcode == 0 for p in procs), (found, [p.exitcode for p in procs])
