"""Triton attention equals the torch reference on the same contexts (CPU via TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.attention import create_attention_backend  # noqa: E402
from engine.attention.torch_backend import TorchAttention  # noqa: E402
from engine.attention.triton_backend import SPLIT_MAX_ROWS, TritonAttention  # noqa: E402
from engine.core import ForwardMode, SamplingParams  # noqa: E402
from engine.kv_cache import KVCacheConfig, KVCacheManager, KVPool  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
# the interpreter runs kernels on CPU tensors; without it the same tests run on the GPU
DEVICE = "cpu" if INTERPRET else "cuda"

MAX_CTX = 64


class Setup:
    """A request table whose rows own shuffled pages, and a pool of random K/V."""

    def __init__(
        self,
        page_size: int,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 16,
        pool_dtype: torch.dtype = torch.float32,
        rows: int = 4,
        seed: int = 0,
        device: str = DEVICE,
        max_ctx: int = MAX_CTX,
    ) -> None:
        self.gen = torch.Generator(device).manual_seed(seed)
        pages_per_row = max_ctx // page_size
        num_pages = rows * pages_per_row + 2
        self.kv = KVCacheManager(KVCacheConfig(num_pages, page_size, rows, max_ctx), device)
        pages = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
        for row in range(1, rows + 1):
            own = pages[(row - 1) * pages_per_row : row * pages_per_row]
            slots = (own.unsqueeze(1) * page_size + torch.arange(page_size)).flatten()
            self.kv.req_to_token[row] = slots.to(device)
        self.pool = KVPool(2, num_pages, page_size, kv_heads, head_dim, pool_dtype, device)
        self.pool.buffer.normal_(generator=self.gen)
        self.heads, self.kv_heads, self.head_dim, self.device = heads, kv_heads, head_dim, device

    def runner(self, pool: KVPool) -> ModelRunner:
        return ModelRunner(None, self.kv, pool, TorchAttention(), self.device)  # type: ignore[arg-type]

    def qkv(self, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        shapes = [(tokens, self.heads, self.head_dim)] + [(tokens, self.kv_heads, self.head_dim)] * 2
        return tuple(torch.randn(s, generator=self.gen, device=self.device).to(dtype) for s in shapes)


def copy_pool(pool: KVPool) -> KVPool:
    b = pool.buffer
    out = KVPool(b.shape[0], b.shape[2], pool.page_size, pool.num_kv_heads, pool.head_dim, b.dtype, b.device)
    out.buffer.copy_(b)
    return out


def compare(
    setup: Setup,
    mode: ForwardMode,
    prefix: list[int],
    extend: list[int],
    *,
    slots: list[int] | None = None,
    tree_mask: torch.Tensor | None = None,
    q_dtype: torch.dtype = torch.float32,
    splits: int | None = None,
    atol: float = 2e-5,
) -> None:
    """Both Triton kernels (split-K and extend, forced either way) equal the torch backend."""
    slots = slots or list(range(1, len(prefix) + 1))
    if tree_mask is not None:
        tree_mask = tree_mask.to(setup.device)
    ref_pool = setup.pool
    rows = max(extend) * setup.heads // setup.kv_heads
    # the default choice, then the other kernel where its tile stays small (split-K holds a
    # request's whole window in one row tile); prompt chunks by the prompt kernel and by the
    # paged extend kernel
    other = 0 if rows <= SPLIT_MAX_ROWS else 128
    variants = [(SPLIT_MAX_ROWS, True), (other, True), (other, False)]
    ctx = setup.runner(ref_pool).make_context(mode, slots, prefix, extend, tree_mask=tree_mask)
    q, k, v = setup.qkv(sum(extend), q_dtype)
    scale = setup.head_dim**-0.5
    torch_backend = TorchAttention()
    torch_backend.prepare(ctx)
    want = torch_backend.forward(q, k, v, 1, scale, ctx)
    # the store rounds like torch only without a cast (the interpreter rounds fp32 -> bf16
    # toward zero, torch to nearest)
    pool_tol = 0 if ref_pool.buffer.dtype == q_dtype else 1e-2
    for split_max_rows, prompt_kernel in variants:
        pool = copy_pool(ref_pool)
        tctx = ctx.with_pool(pool)
        backend = TritonAttention(num_kv_splits=splits, split_max_rows=split_max_rows, prompt_kernel=prompt_kernel)
        backend.prepare(tctx)
        got = backend.forward(q, k, v, 1, scale, tctx)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(
            got.float(),
            want.float(),
            atol=atol,
            rtol=atol,
            msg=lambda m: f"split_max_rows={split_max_rows} prompt_kernel={prompt_kernel}: {m}",
        )
        torch.testing.assert_close(pool.buffer, ref_pool.buffer, atol=pool_tol, rtol=pool_tol)


def test_registry_and_graph_flag() -> None:
    backend = create_attention_backend("triton")
    assert backend.name == "triton" and backend.graph_safe
    assert not create_attention_backend("torch").graph_safe


def test_missing_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.attention import base

    def no_triton(name: str) -> None:
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.delitem(base._BACKENDS, "triton", raising=False)
    monkeypatch.setattr(base.importlib, "import_module", no_triton)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        create_attention_backend("triton")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_ragged_gqa(page_size: int, splits: int | None) -> None:
    setup = Setup(page_size, heads=4, kv_heads=2)
    # ragged lengths including a request whose only key is the new token
    compare(setup, ForwardMode.DECODE, [40, 0, 17, 5], [1, 1, 1, 1], slots=[3, 1, 4, 2], splits=splits)


def test_decode_mha_head_dim_32() -> None:
    compare(Setup(4, heads=2, kv_heads=2, head_dim=32), ForwardMode.DECODE, [9, 33], [1, 1], splits=4)


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_fresh_and_chunked(page_size: int) -> None:
    setup = Setup(page_size)
    # fresh prompts, and a chunk after a cached prefix (prefix > 0), ragged
    compare(setup, ForwardMode.EXTEND, [0, 21, 0], [19, 7, 3], slots=[2, 3, 1])


def test_extend_group_4_rows_span_blocks() -> None:
    compare(Setup(16, heads=8, kv_heads=2), ForwardMode.EXTEND, [5, 30], [11, 2])


def test_target_verify_chain() -> None:
    compare(Setup(4), ForwardMode.TARGET_VERIFY, [12, 1, 30], [4, 4, 4])


def random_tree(bs: int, rows: int, width: int, seed: int) -> torch.Tensor:
    """Each query sees itself and a random subset of the window (not only earlier slots)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(bs, rows, width, generator=gen) < 0.5
    eye = torch.zeros(rows, width, dtype=torch.bool)
    eye[:, width - rows :] = torch.eye(rows, dtype=torch.bool)
    return mask | eye


def test_target_verify_tree() -> None:
    compare(Setup(4), ForwardMode.TARGET_VERIFY, [12, 3], [6, 6], tree_mask=random_tree(2, 6, 6, 1))


def test_draft_steps_decode_with_tree() -> None:
    setup = Setup(4)
    k, seq = 3, [10, 25]
    for step in (1, 2, 3):  # the tree window grows by k each draft step (spec/eagle_draft.py)
        compare(
            setup,
            ForwardMode.DECODE,
            [s + (step - 1) * k for s in seq],
            [k, k],
            tree_mask=random_tree(2, k, step * k, step),
        )


def test_decode_chain_multi_token_no_tree() -> None:
    compare(Setup(4), ForwardMode.DECODE, [7, 20], [2, 2])


def test_pool_dtype_differs_from_q() -> None:
    # activations in fp32, pool in bf16: stores cast down, loads cast up
    setup = Setup(4, pool_dtype=torch.bfloat16)
    compare(setup, ForwardMode.DECODE, [30, 3], [1, 1], splits=2, atol=1e-2)
    compare(setup, ForwardMode.EXTEND, [8, 0], [9, 5], atol=1e-2)


def test_bf16_activations_fp32_pool() -> None:
    setup = Setup(4, pool_dtype=torch.float32)
    compare(setup, ForwardMode.DECODE, [30, 3], [1, 1], q_dtype=torch.bfloat16, splits=2, atol=3e-2)
    compare(setup, ForwardMode.EXTEND, [8, 0], [9, 5], q_dtype=torch.bfloat16, atol=3e-2)


def test_engine_greedy_equals_torch(tiny_llama_dir) -> None:
    from engine.engine import Engine, EngineConfig

    prompts = [[5, 17, 42, 7, 99, 3, 11, 250, 31], [8, 1], list(range(100, 121))]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for name in ("torch", "triton"):
        eng = Engine(
            EngineConfig(
                str(tiny_llama_dir),
                page_size=4,
                chunked_prefill_size=16,
                max_total_tokens=512,
                attention_backend=name,
                device=DEVICE,
            )
        )
        outs[name] = [o.output_ids for o in eng.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


def test_eagle_tree_greedy_equals_torch(tmp_path, tiny_llama_dir) -> None:
    """Draft steps (DECODE, k tokens, tree mask), tree verify and draft-extend end to end."""
    from engine.engine import Engine, EngineConfig
    from fixtures.tiny_eagle import write_tiny_eagle_head
    from spec.config import SpecConfig
    from spec.registry import bind

    head = write_tiny_eagle_head(tmp_path / "head", tiny_llama_dir, "eagle", mode="repeat")
    prompts = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5]
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    outs = {}
    for name in ("torch", "triton"):
        eng = Engine(
            EngineConfig(
                str(tiny_llama_dir), page_size=4, chunked_prefill_size=7, attention_backend=name, device=DEVICE
            ),
            algorithm=bind(SpecConfig("EAGLE", str(head), 3, 2, 5)),
        )
        outs[name] = [o.output_ids for o in eng.generate(prompts, params)]
        assert eng.executor.stats.verifies > 0
    assert outs["triton"] == outs["torch"]
