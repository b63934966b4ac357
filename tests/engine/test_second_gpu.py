"""An engine on the second GPU (as a decode node on cuda:1 is, beside a prefill on cuda:0): its
kernels, graphs and scheduler thread run on that GPU and its output equals the first GPU's."""

from __future__ import annotations

import queue

import pytest
import torch

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from engine.loop import EngineLoop, ThreadedIO
from fixtures.tiny_eagle import write_tiny_eagle_head

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [8, 1], list(range(100, 121))]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
TIMEOUT = 60.0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _engine(model_dir, head_dir, device: str, io=None) -> Engine:
    from spec.config import SpecConfig
    from spec.registry import bind

    cfg = EngineConfig(
        str(model_dir),
        device=device,
        dtype="float32",
        page_size=4,
        attention_backend="triton",
        overlap=True,
        cuda_graph_max_bs=8,
    )
    return Engine(cfg, algorithm=bind(SpecConfig("EAGLE", str(head_dir), 3, 1, None)), io=io)


def _serve(eng: Engine) -> tuple[list[list[int]], int]:
    """Generate through the threaded serving loop; also report the loop thread's current device."""
    lp = EngineLoop(eng).start()
    try:
        outs = []
        for i, ids in enumerate(PROMPTS):
            q: queue.Queue = queue.Queue()
            lp.submit(eng.make_request(ids, GREEDY, f"r{i}"), q.put)
            tokens: list[int] = []
            while True:
                upd = q.get(timeout=TIMEOUT)
                tokens += upd.tokens
                if upd.finished:
                    break
            outs.append(tokens)
        current = lp.call(torch.cuda.current_device).result(TIMEOUT)
        assert lp.call(lambda: eng.kv.all_free).result(TIMEOUT)
        return outs, current
    finally:
        lp.stop()


def test_engine_on_cuda1_equals_cuda0(tiny_llama_dir, tmp_path):
    head = write_tiny_eagle_head(tmp_path / "head", tiny_llama_dir, "eagle", mode="repeat")
    first, dev0 = _serve(_engine(tiny_llama_dir, head, "cuda:0", ThreadedIO()))
    torch.cuda.set_device(0)  # this thread's device must not matter to the engine on cuda:1
    second, dev1 = _serve(_engine(tiny_llama_dir, head, "cuda:1", ThreadedIO()))
    assert (dev0, dev1) == (0, 1)
    assert second == first


def test_an_engine_leaves_its_callers_device_alone(tiny_llama_dir, tmp_path):
    """Building and stepping an engine on cuda:1 from a thread on cuda:0 runs its kernels on GPU 1
    and leaves the thread on GPU 0: Triton kernels launched later by that thread on GPU 0's
    tensors (and graphs it captures) must not land on GPU 1."""
    head = write_tiny_eagle_head(tmp_path / "head", tiny_llama_dir, "eagle", mode="repeat")
    torch.cuda.set_device(0)
    on_gpu0 = _engine(tiny_llama_dir, head, "cuda:0").generate(PROMPTS, GREEDY)
    eng = _engine(tiny_llama_dir, head, "cuda:1")
    assert torch.cuda.current_device() == 0
    on_gpu1 = eng.generate(PROMPTS, GREEDY)
    assert torch.cuda.current_device() == 0
    assert [o.output_ids for o in on_gpu1] == [o.output_ids for o in on_gpu0]
    assert eng.kv.all_free
