"""PD between nodes of different tensor-parallel sizes (real processes, real NIXL over UCX, every
rank its own agent): for prefill TP p and decode TP d in {1, 2}, greedy output and acceptance equal
a colocated TP 1 node's, with EAGLE; prompts long enough to go in chunks (pages sent ahead by each
rank as they are computed); random aborts leave every page of both nodes free. On two GPUs (the
`gpu` tests) the same for 1 -> 2 and 2 -> 1 over NCCL and NIXL in VRAM: three ranks on two GPUs,
so one GPU holds a rank of each node (KV capped so both fit)."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Iterator

import pytest
import torch
from smg_grpc_proto import sglang_scheduler_pb2 as pb

from engine.kv_transfer import nixl_available
from fixtures.pdkit import Legs, pd_generate, request, stub, wait_idle
from fixtures.procs import Node
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not nixl_available(), reason="nixl-cu13 is not installed")]

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], list(range(100, 160)), [8, 1]]


def _common(root: Path) -> list[str]:
    target = write_tiny_model(root / "t", seed=1)  # 4 heads over 2 KV heads: one KV head per rank at TP 2
    head = write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat")
    return [
        "--model",
        str(target),
        "--port",
        "0",
        "--page-size",
        "4",
        "--chunked-prefill-size",
        "16",
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "3",
        "--speculative-draft-model-path",
        str(head),
    ]


def _colocated(common: list[str]) -> Iterator[tuple[list[str], list]]:
    """A colocated TP 1 node's greedy outputs for PROMPTS (the oracle): yields (common, outputs)."""
    colo = Node(["serve", *common])
    try:
        colo.wait_ready(180)
        c = stub(colo.ports["scheduler"])
        want = [
            list(c.Generate(request(f"c{i}", ids, 0, 0, max_new=24), timeout=60))[-1].complete
            for i, ids in enumerate(PROMPTS)
        ]
        yield common, want
    finally:
        colo.kill()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    yield from _colocated(_common(tmp_path_factory.mktemp("pd-tp")))


@pytest.fixture(scope="module")
def gpu_setup(tmp_path_factory: pytest.TempPathFactory):
    common = [*_common(tmp_path_factory.mktemp("pd-tp-gpu")), "--max-total-tokens", "8192"]
    yield from _colocated([*common, "--device", "cuda:0"])


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 2)])
def test_pd_across_tp_sizes_equals_colocated(setup, p: int, d: int) -> None:
    common, want = setup
    _check_pair(common, want, ["--tp-size", str(p)], ["--tp-size", str(d)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("p,d,decode_gpu", [(1, 2, 0), (2, 1, 1)])
def test_pd_across_tp_sizes_on_two_gpus_equals_colocated(gpu_setup, p: int, d: int, decode_gpu: int) -> None:
    common, want = gpu_setup
    prefill = ["--tp-size", str(p), "--device", "cuda:0"]
    _check_pair(common, want, prefill, ["--tp-size", str(d), "--device", f"cuda:{decode_gpu}"])


def _check_pair(common: list[str], want: list, prefill_flags: list[str], decode_flags: list[str]) -> None:
    """Greedy output and acceptance of a prefill/decode pair equal `want`; then random aborts
    leave both nodes with every page free."""
    prefill = Node(["prefill", *common, *prefill_flags, "--bootstrap-port", "0"])
    decode = Node(["decode", *common, *decode_flags])
    p, d = prefill_flags[1], decode_flags[1]
    try:
        prefill.wait_ready(180)
        decode.wait_ready(180)
        ps, ds = stub(prefill.ports["scheduler"]), stub(decode.ports["scheduler"])
        boot = prefill.ports["bootstrap"]
        for i, ids in enumerate(PROMPTS):
            got, _ = pd_generate(ps, ds, request(f"pd{i}", ids, 100 + i, boot, max_new=24))
            done = got[-1].complete
            assert list(done.output_ids) == list(want[i].output_ids), (p, d, i)
            assert (done.spec_accepted_tokens, done.spec_draft_tokens) == (
                want[i].spec_accepted_tokens,
                want[i].spec_draft_tokens,
            ), (p, d, i)
        _random_aborts(ps, ds, boot)
        wait_idle(ps, 30)
        wait_idle(ds, 30)
    finally:
        prefill.kill()
        decode.kill()


def _random_aborts(ps, ds, boot: int) -> None:
    """Clients that hang up, and Abort RPCs to both nodes, at random moments of the handoff."""
    rng = random.Random(0)
    legs_all, timers = [], []
    for i in range(8):
        ids = PROMPTS[i % len(PROMPTS)]
        legs = Legs(request(f"ab{i}", ids, 200 + i, boot, max_new=24), prefill=ps, decode=ds, timeout=60)
        if i % 2:
            timer = threading.Timer(rng.uniform(0.0, 0.4), legs.drop)
        else:
            abort = pb.AbortRequest(request_id=f"ab{i}", reason="test")
            timer = threading.Timer(rng.uniform(0.0, 0.4), lambda a=abort: [s.Abort(a, timeout=10) for s in (ps, ds)])
        timer.start()
        legs_all.append(legs)
        timers.append(timer)
    for legs, timer in zip(legs_all, timers):
        legs.join(60)
        timer.join(10)
