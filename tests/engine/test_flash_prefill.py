"""The triton_flash attention backend (engine/attention/flash_prefill.py): long prompts with no
cached prefix attended by torch's flash kernel, everything else by the triton kernels. Greedy
output equals the torch reference with chunked prompts, prefix-cache hits and EAGLE, the flash
path really runs (and only where it may), and a refusal by torch falls back to triton for good."""

from __future__ import annotations

import json
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.attention import flash_prefill  # noqa: E402
from engine.attention.flash_prefill import FlashPrefillAttention  # noqa: E402
from engine.core import SamplingParams  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cpu" if INTERPRET else "cuda"
PROMPTS = [list(range(3, 40)), [8, 1], list(range(100, 131)), list(range(3, 40)) + [7, 7, 7]]


def _generate(model_dir, backend: str, chunk: int, algorithm=None, prompts=PROMPTS) -> list[list[int]]:
    from engine.engine import Engine, EngineConfig

    config = EngineConfig(
        str(model_dir),
        page_size=4,
        chunked_prefill_size=chunk,
        max_total_tokens=1024,
        attention_backend=backend,
        device=DEVICE,
    )
    eng = Engine(config, algorithm=algorithm) if algorithm is not None else Engine(config)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    # one at a time: the fourth prompt then finds the first one's pages in the prefix cache
    return [eng.generate([p], params)[0].output_ids for p in prompts]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Flash forwards torch served, by prompt length; prompts of 16 tokens and more take the path."""
    monkeypatch.setattr(flash_prefill, "FLASH_MIN_TOKENS", 16)
    seen: list[int] = []
    flash = FlashPrefillAttention._flash

    def counting(self, q, k, v, scale):  # type: ignore[no-untyped-def]
        out = flash(self, q, k, v, scale)
        if out is not None:  # not refused
            seen.append(q.shape[0])
        return out

    monkeypatch.setattr(FlashPrefillAttention, "_flash", counting)
    return seen


@pytest.mark.parametrize("chunk", [64, 16])
def test_greedy_equals_torch_and_only_fresh_long_prompts_take_flash(tiny_llama_dir, counted, chunk) -> None:
    want = _generate(tiny_llama_dir, "torch", chunk)
    assert _generate(tiny_llama_dir, "triton_flash", chunk) == want
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    # whole prompts of 37 and 31 tokens, or (16-token chunks) only each prompt's first chunk;
    # never the 2-token one, nor the fourth prompt, which starts from the first one's cached pages
    firsts = [37, 31] if chunk == 64 else [16, 16]
    assert sorted(counted) == sorted(firsts * layers)


def test_a_batch_of_fresh_prompts_runs_one_flash_call_each(tiny_llama_dir, counted) -> None:
    from engine.engine import Engine, EngineConfig

    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton_flash"):
        config = EngineConfig(
            str(tiny_llama_dir), page_size=4, max_total_tokens=1024, attention_backend=backend, device=DEVICE
        )
        eng = Engine(config)
        together = [PROMPTS[0], PROMPTS[2]]  # two fresh prompts in one batch: flash, one call each
        mixed = [list(range(200, 240)), PROMPTS[1]]  # one under the threshold: the whole batch on triton
        outs[backend] = [o.output_ids for o in eng.generate(together, params) + eng.generate(mixed, params)]
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    assert outs["triton_flash"] == outs["torch"] and sorted(counted) == sorted([37, 31] * layers)


def test_eagle_greedy_equals_torch(tmp_path, tiny_llama_dir, counted) -> None:
    from fixtures.tiny_eagle import write_tiny_eagle_head
    from spec.config import SpecConfig
    from spec.registry import bind

    head = write_tiny_eagle_head(tmp_path / "head", tiny_llama_dir, "eagle", mode="repeat")
    spec = lambda: bind(SpecConfig("EAGLE", str(head), 3, 2, 5))  # noqa: E731
    two = [PROMPTS[0], PROMPTS[3]]  # a fresh prompt, then one that starts from its cached pages
    got = _generate(tiny_llama_dir, "triton_flash", 64, spec(), two)
    assert got == _generate(tiny_llama_dir, "torch", 64, spec(), two)
    assert counted  # the target's and the draft's prompts took it


def test_a_refusal_falls_back_to_triton_for_good(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash_prefill, "FLASH_MIN_TOKENS", 16)
    calls = []

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(flash_prefill, "scaled_dot_product_attention", refuse)
    assert _generate(tiny_llama_dir, "triton_flash", 64) == _generate(tiny_llama_dir, "torch", 64)
    assert len(calls) == 1  # refused once, never asked again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_half_precision_prompts_take_torchs_flash_kernel_and_equal_triton(tiny_llama_dir, counted) -> None:
    """On a GPU in half precision torch has a flash kernel for these prompts (no refusal), and greedy output
    equals the triton backend's."""
    from engine.engine import Engine, EngineConfig

    outs = {}
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 400)), list(range(50, 350))]
    for backend in ("triton", "triton_flash"):
        config = EngineConfig(
            str(tiny_llama_dir),
            page_size=16,
            max_total_tokens=4096,
            attention_backend=backend,
            device="cuda",
            dtype="float16",  # flash takes fp16 and bf16; fp16 keeps argmax ties between kernels rarer
        )
        eng = Engine(config)
        outs[backend] = [eng.generate([p], params)[0].output_ids for p in prompts]  # one at a time: fresh
        del eng
        torch.cuda.empty_cache()
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    assert sorted(counted) == sorted([397, 300] * layers)  # torch served every layer of both prompts
    assert outs["triton_flash"] == outs["triton"]
