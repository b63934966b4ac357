"""KV cache sizing from --mem-fraction-static: the pure rule with made-up memory numbers, the GPU path
with a faked torch.cuda.mem_get_info, the draft model's share and the CPU default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import kv_budget
from engine.engine import Engine, EngineConfig
from engine.kv_budget import CPU_KV_TOKENS, KVBudgetError, draft_footprint, kv_bytes_per_token, kv_cache_tokens

GIB = 1 << 30


def test_the_share_left_after_weights_becomes_whole_pages() -> None:
    # 80 GiB card, 0.85 of it for weights + KV, weights took 16 GiB: 68 - 16 = 52 GiB of KV
    per_token = kv_bytes_per_token(32, 8, 128, 2)  # an 8B Llama in bf16: 128 KiB a token
    assert per_token == 128 * 1024
    tokens = kv_cache_tokens(80 * GIB, 64 * GIB, 0.85, per_token, page_size=16)
    budget = 64 * GIB - int(80 * GIB * 0.15)
    assert tokens % 16 == 0
    # every page fits, page 0 included, and one more page would not
    assert (tokens + 16) * per_token <= budget < (tokens + 32) * per_token


def test_a_fraction_of_one_gives_everything_free() -> None:
    assert kv_cache_tokens(1000, 800, 1.0, 10, 4) == (800 // 40 - 1) * 4


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.01, 2.0])
def test_fraction_outside_0_1_is_refused(fraction: float) -> None:
    with pytest.raises(KVBudgetError, match="--mem-fraction-static must be in"):
        kv_cache_tokens(80 * GIB, 60 * GIB, fraction, 1024, 16)


def test_less_than_one_page_is_a_clear_error() -> None:
    # weights took 70 of 80 GiB; 0.85 leaves 68 GiB for weights + KV: nothing for the cache
    with pytest.raises(KVBudgetError) as err:
        kv_cache_tokens(80 * GIB, 10 * GIB, 0.85, 128 * 1024, 16)
    assert "--mem-fraction-static" in str(err.value) and "--max-total-tokens" in str(err.value)
    # room for page 0 only is still no room
    with pytest.raises(KVBudgetError):
        kv_cache_tokens(1000, 999, 1.0, 10, 50)
    assert kv_cache_tokens(1000, 1000, 1.0, 10, 50) == 50  # page 0 and one page


def test_gpu_sizing_reads_device_memory_and_counts_a_pending_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * GIB, 80 * GIB))
    cuda = torch.device("cuda:0")
    alone = kv_budget.size_kv_cache(cuda, 0.9, 16, 1024)
    assert alone == kv_cache_tokens(80 * GIB, 40 * GIB, 0.9, 1024, 16)
    with_draft = kv_budget.size_kv_cache(cuda, 0.9, 16, 1024, pending_weight_bytes=8 * GIB)
    assert with_draft == kv_cache_tokens(80 * GIB, 32 * GIB, 0.9, 1024, 16) < alone


def test_cpu_keeps_the_fixed_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: pytest.fail("no device memory on a CPU"))
    assert kv_budget.size_kv_cache(torch.device("cpu"), 0.5, 16, 1024) == CPU_KV_TOKENS
    with pytest.raises(KVBudgetError):
        kv_budget.size_kv_cache(torch.device("cpu"), 0.0, 16, 1024)  # still validated


def test_draft_footprint_reads_the_heads_config_and_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096})
    )
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    assert draft_footprint(str(tmp_path), 2) == (kv_bytes_per_token(1, 8, 128, 2), 1000)
    assert draft_footprint(None, 2) == (0, 0)


def test_unset_capacity_on_cpu_is_the_default(tiny_llama_dir: Path) -> None:
    eng = Engine(EngineConfig(str(tiny_llama_dir), page_size=4, max_total_tokens=None))
    assert eng.kv.allocator.total * eng.kv.page_size == CPU_KV_TOKENS


def test_engine_config_validates_the_fraction(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        EngineConfig(str(tiny_llama_dir), mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="max_total_tokens"):
        EngineConfig(str(tiny_llama_dir), max_total_tokens=0)
