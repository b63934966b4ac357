"""Our Llama-family forward equals transformers' on the same weights: prefill and paged decode."""

from __future__ import annotations

import pytest
import torch

from engine.attention import create_attention_backend
from engine.core import ForwardMode
from engine.kv_cache import KVCacheConfig, KVCacheManager, KVPool
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.core import Req, SamplingParams
from tests.engine.hf_models import HF_ARCHS, write_hf_model


def _runner(model_dir, page_size=4):
    model, cfg = load_model(model_dir, "float32")
    kv = KVCacheManager(KVCacheConfig(num_pages=64, page_size=page_size, max_reqs=4, max_context_len=256), "cpu")
    pool = KVPool(cfg.num_layers, 64, page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    return ModelRunner(model, kv, pool, create_attention_backend("torch"), "cpu"), kv


@pytest.mark.parametrize("kind", sorted(HF_ARCHS))
def test_prefill_then_decode_logits_match_transformers(tmp_path, kind):
    import transformers

    path = write_hf_model(tmp_path / kind, kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    runner, kv = _runner(path)
    prompts = [[5, 17, 42, 7, 99, 3, 11], [8, 1, 250]]
    reqs = [Req(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for r in reqs:
        kv.assign_slot(r)
        kv.reserve(r, 64)
    # prefill both prompts in one packed batch
    ctx = runner.make_context(ForwardMode.EXTEND, [r.slot for r in reqs], [0, 0], [len(p) for p in prompts])
    ids = torch.tensor(sum(prompts, []))
    hidden, _ = runner.forward(ids, ctx)
    logits = runner.logits(hidden)
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0] for p in prompts]
    torch.testing.assert_close(logits[:7], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[7:], ref[1], atol=1e-4, rtol=1e-4)
    # incremental decode: feed 5 more tokens one at a time through the paged cache
    seqs = [list(p) for p in prompts]
    for step in range(5):
        nxt = [int(logits_row.argmax()) for logits_row in (runner.logits(hidden)[[6, 9]] if step == 0 else logits)]
        ctx = runner.make_context(ForwardMode.DECODE, [r.slot for r in reqs], [len(s) for s in seqs], [1, 1])
        hidden, _ = runner.forward(torch.tensor(nxt), ctx)
        logits = runner.logits(hidden)
        for s, t in zip(seqs, nxt):
            s.append(t)
        with torch.no_grad():
            ref_rows = torch.stack([hf(torch.tensor([s])).logits[0, -1] for s in seqs])
        torch.testing.assert_close(logits, ref_rows, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_matches_single_pass(tmp_path):
    path = write_hf_model(tmp_path / "m", "llama")
    runner, kv = _runner(path, page_size=3)
    prompt = list(range(1, 30))
    r = Req("c", prompt, SamplingParams())
    kv.assign_slot(r)
    kv.reserve(r, 40)
    full, _ = runner.forward(
        torch.tensor(prompt), runner.make_context(ForwardMode.EXTEND, [r.slot], [0], [len(prompt)])
    )
    chunks, start = [], 0
    for n in (7, 10, 12):
        h, _ = runner.forward(
            torch.tensor(prompt[start : start + n]), runner.make_context(ForwardMode.EXTEND, [r.slot], [start], [n])
        )
        chunks.append(h)
        start += n
    torch.testing.assert_close(torch.cat(chunks), full, atol=1e-5, rtol=1e-5)
