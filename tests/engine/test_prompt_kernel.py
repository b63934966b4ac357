"""The prompt attention kernel (engine/attention/triton_kernels/prompt.py): packed chunks over
paged prefixes equal fp32 attention and the paged extend kernel, with GQA, in bf16 and fp32 and
on a grid sized past the longest chunk; the engine's prompts take it (target and EAGLE draft),
and greedy output equals the torch backend's with whole and chunked prompts and prefix hits."""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.attention import triton_backend  # noqa: E402
from engine.attention.triton_kernels.common import TileConfig  # noqa: E402
from engine.attention.triton_kernels.extend import extend_attention  # noqa: E402
from engine.attention.triton_kernels.prompt import prompt_attention  # noqa: E402
from engine.core import SamplingParams  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cpu" if INTERPRET else "cuda"
PROMPTS = [list(range(3, 40)), [8, 1], list(range(100, 131)), list(range(3, 40)) + [7, 7, 7]]


class Chunks:
    """Requests of (prefix, chunk) tokens: the chunks' q/k/v as views of one projection output
    (strided like the model's), the prefixes in a pool of shuffled slots."""

    def __init__(self, shape: list[tuple[int, int]], heads: int, kv_heads: int, dtype: torch.dtype) -> None:
        gen = torch.Generator(DEVICE).manual_seed(len(shape) * 7 + heads)
        dim, tokens = 32, sum(e for _, e in shape)
        width = (heads + 2 * kv_heads) * dim
        qkv = torch.randn(tokens, width, generator=gen, device=DEVICE).to(dtype)
        self.q = qkv[:, : heads * dim].view(tokens, heads, dim)
        self.k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        self.v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        slots_total = sum(p + e for p, e in shape) + 8
        self.k_cache = torch.randn(slots_total, kv_heads, dim, generator=gen, device=DEVICE).to(dtype)
        self.v_cache = torch.randn(slots_total, kv_heads, dim, generator=gen, device=DEVICE).to(dtype)
        order = torch.randperm(slots_total, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        self.table = torch.zeros(len(shape) + 1, 128, dtype=torch.int32, device=DEVICE)
        starts, used = [0], 0
        for i, (p, e) in enumerate(shape):
            slots = order[used : used + p + e]
            used += p + e
            self.table[i + 1, : p + e] = slots.to(torch.int32)  # table rows 1..n: row 0 stays unused
            self.k_cache[slots[p:]] = self.k[starts[-1] : starts[-1] + e]
            self.v_cache[slots[p:]] = self.v[starts[-1] : starts[-1] + e]
            starts.append(starts[-1] + e)
        self.shape = shape
        self.rows = (
            torch.arange(1, len(shape) + 1, dtype=torch.int32, device=DEVICE),
            torch.tensor([p + e for p, e in shape], dtype=torch.int32, device=DEVICE),
            torch.tensor([e for _, e in shape], dtype=torch.int32, device=DEVICE),
            torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        )
        self.scale = 1 / math.sqrt(dim)

    def reference(self) -> torch.Tensor:
        outs = []
        group = self.q.shape[1] // self.k.shape[1]
        for i, (p, e) in enumerate(self.shape):
            slots = self.table[i + 1, : p + e].long()
            k = self.k_cache[slots].float().repeat_interleave(group, 1)
            v = self.v_cache[slots].float().repeat_interleave(group, 1)
            start = int(self.rows[3][i])
            s = torch.einsum("thd,shd->hts", self.q[start : start + e].float(), k) * self.scale
            causal = torch.arange(p + e, device=DEVICE)[None, :] <= (p + torch.arange(e, device=DEVICE))[:, None]
            outs.append(torch.einsum("hts,shd->thd", s.masked_fill(~causal, float("-inf")).softmax(-1), v))
        return torch.cat(outs)

    def prompt(self, cfg: TileConfig, max_extend: int) -> torch.Tensor:
        out = torch.empty_like(self.q)
        args = (self.k_cache, self.v_cache, self.table, *self.rows, max_extend, self.scale, cfg, out)
        return prompt_attention(self.q, self.k, self.v, *args)

    def extend(self, max_extend: int) -> torch.Tensor:
        out = torch.empty_like(self.q)
        args = (self.table, *self.rows, max_extend, None, self.scale, TileConfig(16, 16), out)
        return extend_attention(self.q, self.k_cache, self.v_cache, *args)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
def test_chunks_over_prefixes_equal_fp32_attention_and_the_extend_kernel(dtype, atol, heads, kv_heads) -> None:
    # fresh prompts, chunks after a prefix, a one-token chunk, ragged against the tile sizes
    chunks = Chunks([(0, 37), (20, 5), (0, 16), (33, 40), (9, 1)], heads, kv_heads, dtype)
    want = chunks.reference()
    for cfg in (TileConfig(16, 16), TileConfig(32, 16)):
        for max_extend in (40, 64):  # the grid's bound may exceed the longest chunk (graphs pad it)
            got = chunks.prompt(cfg, max_extend)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)
    torch.testing.assert_close(
        chunks.prompt(TileConfig(16, 16), 40).float(), chunks.extend(40).float(), atol=atol, rtol=atol
    )


def test_only_power_of_two_head_dims_up_to_128_fit() -> None:
    from engine.attention.triton_kernels.prompt import prompt_kernel_fits

    assert [d for d in (8, 16, 24, 64, 96, 128, 256) if prompt_kernel_fits(d)] == [16, 64, 128]


def test_a_head_dim_that_is_not_a_power_of_two_is_refused() -> None:
    chunks = Chunks([(0, 4)], 2, 2, torch.float32)
    q = torch.zeros(4, 2, 24, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        prompt_attention(q, q, q, q, q, chunks.table, *chunks.rows, 4, 1.0, TileConfig(16, 16), q)


def _generate(model_dir, chunk: int, algorithm=None, prompts=PROMPTS, backend: str = "triton") -> list[list[int]]:
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
    """Prompt kernel launches, by their grid's chunk bound."""
    seen: list[int] = []
    launch = triton_backend.prompt_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(args[10])  # max_extend
        return launch(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "prompt_attention", counting)
    return seen


@pytest.mark.parametrize("chunk", [64, 40])
def test_engine_prompts_take_the_prompt_kernel_and_equal_torch(tiny_llama_dir, counted, chunk) -> None:
    want = _generate(tiny_llama_dir, chunk, backend="torch")
    assert not counted
    assert _generate(tiny_llama_dir, chunk) == want
    # prompts longer than a split-K window (64 query rows) ran on it, chunk by chunk
    assert counted and max(counted) <= chunk


def test_eagle_greedy_equals_torch(tmp_path, tiny_llama_dir, counted) -> None:
    from fixtures.tiny_eagle import write_tiny_eagle_head
    from spec.config import SpecConfig
    from spec.registry import bind

    head = write_tiny_eagle_head(tmp_path / "head", tiny_llama_dir, "eagle", mode="repeat")
    spec = lambda: bind(SpecConfig("EAGLE", str(head), 3, 2, 5))  # noqa: E731
    two = [PROMPTS[0], PROMPTS[3]]  # a fresh prompt, then one that starts from its cached pages
    got = _generate(tiny_llama_dir, 64, spec(), two)
    assert counted  # the target's and the draft's prompts took it
    assert got == _generate(tiny_llama_dir, 64, spec(), two, backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_half_precision_prompt_kernel_equals_the_extend_kernel(tiny_llama_dir, counted) -> None:
    """Long prompts in fp16 on the GPU's tile settings: greedy output with the prompt kernel
    equals the paged extend kernel's, whole and in chunks over their own cached prefix."""
    from engine.engine import Engine, EngineConfig

    outs = {}
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 400)), list(range(50, 350)), list(range(3, 400)) + list(range(7, 90))]
    for prompt_kernel in (True, False):
        config = EngineConfig(
            str(tiny_llama_dir),
            page_size=16,
            max_total_tokens=4096,
            chunked_prefill_size=256,
            attention_backend="triton",
            device="cuda",
            dtype="float16",
        )
        eng = Engine(config)
        eng.parts.runner.attn_backend.prompt_kernel = prompt_kernel
        outs[prompt_kernel] = [eng.generate([p], params)[0].output_ids for p in prompts]
        del eng
        torch.cuda.empty_cache()
    assert counted and outs[True] == outs[False]
