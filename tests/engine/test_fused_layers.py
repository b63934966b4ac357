"""Fused Triton layer kernels (RMSNorm + residual, rotary, SiLU*mul) equal the torch reference.

CPU: kernels run under TRITON_INTERPRET=1 on tiny shapes, forced on through dispatch.fused_ops.
GPU (`gpu` marker): real sizes (hidden 4096, bf16, 1..4096 tokens) and CUDA graph capture.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the kernels' import: jit picks the interpreter then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.layers.activation import silu_and_mul  # noqa: E402
from engine.layers.dispatch import fused_ops, kernels_for  # noqa: E402
from tests.engine.fused_paths import both_paths  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # fp32: summation order only; bf16: one rounding step apart at most (another fp32 sum order
    # can flip a bf16 rounding, and Triton's interpreter truncates fp32 -> bf16 where GPUs round)
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


def _exact(dtype: torch.dtype) -> dict[str, float]:
    """For results with one rounding and no reduction: bit-equal, except the interpreter's bf16."""
    return dict(atol=0, rtol=0) if dtype == torch.float32 or DEV == "cuda" else _tol(dtype)


def _norm(dim: int, dtype: torch.dtype, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(dim, eps).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [48, 64, 96])
def test_rmsnorm_and_fused_residual_add(dtype: torch.dtype, dim: int) -> None:
    torch.manual_seed(dim)
    norm = _norm(dim, dtype)
    x = torch.randn(5, dim, device=DEV).to(dtype)
    res = torch.randn(5, dim, device=DEV).to(dtype)
    ref, got = both_paths(lambda: norm(x))
    assert got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, **_tol(dtype))
    (ref_out, ref_res), (got_out, got_res) = both_paths(lambda: norm.forward_add(x, res))
    torch.testing.assert_close(got_res, ref_res, **_exact(dtype))  # one add, same rounding
    torch.testing.assert_close(got_out, ref_out, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_head_norm_on_strided_view(dtype: torch.dtype) -> None:
    """Per-head q norm reading q straight out of a wider (fused qkv-like) projection output."""
    torch.manual_seed(1)
    heads, head_dim = 3, 48
    norm = _norm(head_dim, dtype)
    qkv = torch.randn(4, (heads + 2) * head_dim, device=DEV).to(dtype)
    q = qkv[:, : heads * head_dim].view(4, heads, head_dim)
    assert not q.is_contiguous()
    ref, got = both_paths(lambda: norm(q))
    assert got.shape == (4, heads, head_dim)
    torch.testing.assert_close(got, ref, **_tol(dtype))


def test_empty_batch_and_cpu_default_is_torch() -> None:
    norm = _norm(48, torch.float32)
    empty = torch.empty(0, 48, device=DEV)
    ref, got = both_paths(lambda: norm.forward_add(empty, empty))
    assert got[0].shape == (0, 48) and got[1].shape == (0, 48)
    if DEV == "cpu":
        assert kernels_for(torch.ones(1)) is None  # auto mode: CPU never takes the Triton path


def test_autograd_keeps_the_torch_path() -> None:
    norm = _norm(48, torch.float32)
    x = torch.randn(3, 48, device=DEV)
    with fused_ops("on"):
        assert kernels_for(x, norm.weight) is None  # the weight requires grad: torch, with backward
        norm(x).sum().backward()
        with torch.no_grad():
            assert kernels_for(x, norm.weight) is not None
    assert norm.weight.grad is not None


def _rope(head_dim: int, scaling: dict | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, 64, 10000.0, scaling).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 48])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_q_and_k(dtype: torch.dtype, head_dim: int, inplace: bool) -> None:
    torch.manual_seed(head_dim)
    rope = _rope(head_dim)
    pos = torch.tensor([0, 3, 17, 63, 5], device=DEV)
    q0 = torch.randn(5, 4, head_dim, device=DEV).to(dtype)
    k0 = torch.randn(5, 2, head_dim, device=DEV).to(dtype)
    ref, got = both_paths(lambda: rope(pos, q0.clone(), k0.clone(), inplace=inplace))
    for r, g in zip(ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, **_tol(dtype))
    if inplace:
        q, k = q0.clone(), k0.clone()
        with fused_ops("on"):
            out_q, out_k = rope(pos, q, k, inplace=True)
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
        torch.testing.assert_close(q, ref[0], **_tol(dtype))


def test_rotary_llama3_scaling_on_strided_views() -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    rope = _rope(32, scaling)
    qkv = torch.randn(3, (4 + 2 + 2) * 32, device=DEV)
    q = qkv[:, :128].view(3, 4, 32)
    k = qkv[:, 128:192].view(3, 2, 32)
    pos = torch.tensor([1, 40, 2], device=DEV)
    ref, got = both_paths(lambda: rope(pos, q, k))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 96])
def test_silu_and_mul_separate_and_fused(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(width)
    gate = (3 * torch.randn(6, width, device=DEV)).to(dtype)
    up = torch.randn(6, width, device=DEV).to(dtype)
    ref, got = both_paths(lambda: silu_and_mul(gate, up))
    torch.testing.assert_close(got, ref, **_tol(dtype))
    gate_up = torch.cat((gate, up), dim=-1)
    ref2, got2 = both_paths(lambda: silu_and_mul(gate_up))
    torch.testing.assert_close(got2, ref, **_tol(dtype))
    torch.testing.assert_close(ref2, ref, **_tol(dtype))  # torch: strided silu rounds its own way


def _runner(model_dir, fuse: bool = False):
    from engine.attention import create_attention_backend
    from engine.kv_cache import KVCacheConfig, KVCacheManager, KVPool
    from engine.loader import load_model
    from engine.model_runner import ModelRunner
    from engine.models.llama import fuse_projections

    model, cfg = load_model(model_dir, "float32", DEV)
    if fuse:
        assert fuse_projections(model) == 2 * cfg.num_layers
    kv = KVCacheManager(KVCacheConfig(num_pages=16, page_size=4, max_reqs=2, max_context_len=32), DEV)
    pool = KVPool(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEV)
    return ModelRunner(model, kv, pool, create_attention_backend("torch"), DEV)


def _logits(runner) -> list[torch.Tensor]:
    """Prefill two prompts (capturing layer 1's input), then one decode step."""
    from engine.core import ForwardMode, Req, SamplingParams

    prompts = [[5, 17, 42, 7, 99], [8, 1, 250]]
    reqs = [Req(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        runner.kv.assign_slot(r)
        runner.kv.reserve(r, 16)
    slots = [r.slot for r in reqs]
    ctx = runner.make_context(ForwardMode.EXTEND, slots, [0, 0], [5, 3], aux_hidden_layers=(1,))
    with torch.inference_mode():
        hidden, aux = runner.forward(torch.tensor(sum(prompts, []), device=DEV), ctx)
        ctx = runner.make_context(ForwardMode.DECODE, slots, [5, 3], [1, 1])
        step, _ = runner.forward(torch.tensor([3, 4], device=DEV), ctx)
    for r in reqs:
        runner.kv.release(r)  # the same runner runs this again
    return [runner.logits(hidden), aux[0], runner.logits(step)]


def _prefill_and_decode_logits(model_dir, fuse: bool = False) -> list[torch.Tensor]:
    return _logits(_runner(model_dir, fuse))


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    from engine.layers import triton_ops

    calls = {name: 0 for name in ("rmsnorm", "rotary", "silu_and_mul")}

    def counted(name: str):
        fn = getattr(triton_ops, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in calls:
        monkeypatch.setattr(triton_ops, name, counted(name))
    return calls


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_model_logits_with_fused_ops_equal_torch(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = request.getfixturevalue(fixture)
    calls = _count_kernel_calls(monkeypatch)
    ref, got = both_paths(lambda: _prefill_and_decode_logits(model_dir))
    # per forward and layer: 2 fused add+norms (+ q/k norms for Qwen3), 1 rotary, 1 silu*mul
    assert calls["rotary"] == calls["silu_and_mul"] == 2 * 2
    assert calls["rmsnorm"] == 2 * (2 * (4 if fixture == "tiny_qwen3_dir" else 2) + 1)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_merged_projections_keep_names_loading_and_logits(fixture: str, request: pytest.FixtureRequest) -> None:
    from engine.loader import checkpoint_files, load_weights

    model_dir = request.getfixturevalue(fixture)
    ref = _prefill_and_decode_logits(model_dir)
    runner = _runner(model_dir, fuse=True)
    model = runner.model
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        assert attn._qkv is not None and attn._qkv.usable()
    assert not attn._qkv.usable()  # autograd recording: the separate parameters need their grads
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn._qkv.weight.data_ptr()
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    with torch.no_grad():  # a load after merging writes through the views into the merged GEMM
        for p in model.parameters():
            p.zero_()
    load_weights(model, checkpoint_files(model_dir))
    with fused_ops("on"):
        got = _logits(runner)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    attn.k_proj.weight.data = attn.k_proj.weight.data.clone()  # views broken: separate GEMMs again
    with torch.no_grad():
        assert not attn._qkv.usable()
    for r, g in zip(ref, _logits(runner)):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


GPU_TOKENS = [1, 3, 64, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
def test_gpu_llama8b_sizes_bf16(tokens: int) -> None:
    torch.manual_seed(tokens)
    bf16 = torch.bfloat16
    norm, head_norm = _norm(4096, bf16, 1e-5), _norm(128, bf16)
    x = torch.randn(tokens, 4096, device=DEV, dtype=bf16)
    res = torch.randn(tokens, 4096, device=DEV, dtype=bf16)
    (ref_out, ref_res), (got_out, got_res) = both_paths(lambda: norm.forward_add(x, res))
    torch.testing.assert_close(got_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(got_out, ref_out, **_tol(bf16))
    rope = RotaryEmbedding(
        128,
        8192,
        500000.0,
        {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ).to(DEV)
    pos = torch.randint(0, 8192, (tokens,), device=DEV)
    qkv = torch.randn(tokens, 48 * 128, device=DEV, dtype=bf16)
    q, k = qkv[:, :4096].view(tokens, 32, 128), qkv[:, 4096:5120].view(tokens, 8, 128)
    for r, g in zip(*both_paths(lambda: rope(pos, q, k))):
        torch.testing.assert_close(g, r, **_tol(bf16))
    ref, got = both_paths(lambda: head_norm(q))
    torch.testing.assert_close(got, ref, **_tol(bf16))
    gate_up = torch.randn(tokens, 2 * 14336, device=DEV, dtype=bf16)
    ref, got = both_paths(lambda: silu_and_mul(gate_up))
    torch.testing.assert_close(got, ref, **_tol(bf16))


@pytest.mark.gpu
def test_gpu_fused_ops_capture_in_cuda_graph() -> None:
    """One layer's elementwise chain, captured then replayed on new inputs, equals eager."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    norm, rope = _norm(4096, bf16), _rope(128)
    x, res = (torch.randn(4, 4096, device=DEV, dtype=bf16) for _ in range(2))
    gate_up = torch.randn(4, 2 * 1024, device=DEV, dtype=bf16)
    pos = torch.tensor([0, 5, 9, 63], device=DEV)

    def chain() -> list[torch.Tensor]:
        h, r = norm.forward_add(x, res)
        q, k = rope(pos, h.view(4, 32, 128), h[:, :1024].reshape(4, 8, 128))
        return [h, r, q, k, silu_and_mul(gate_up)]

    with fused_ops("on"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain()  # compile and load every kernel before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain()
        for t in (x, res, gate_up):
            t.copy_(torch.randn_like(t))
        pos.copy_(torch.tensor([1, 2, 3, 4]))
        graph.replay()
        torch.cuda.synchronize()
        eager = chain()
    for o, e in zip(outs, eager):
        torch.testing.assert_close(o, e, atol=0, rtol=0)
