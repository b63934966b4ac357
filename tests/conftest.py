"""Shared test fixtures: tiny HF-format model directories and the `gpu` marker's skip."""

from __future__ import annotations

from pathlib import Path

import pytest

# Kept cheap: torch and the model writer are imported only when a fixture or a gpu test needs them.


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama: GQA (4 heads, 2 kv heads), untied lm_head, vocab padded from the tokenizer."""
    from fixtures.tiny_model import write_tiny_model

    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM", seed=0, num_heads=4, num_kv_heads=2
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2: q/k/v biases and tied embeddings, as small Qwen2.5 checkpoints have."""
    from fixtures.tiny_model import write_tiny_model

    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen2"),
        "Qwen2ForCausalLM",
        seed=1,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3: q/k norms, head_dim (32) decoupled from hidden/heads (16), two weight shards."""
    from fixtures.tiny_model import write_tiny_model

    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3"),
        "Qwen3ForCausalLM",
        seed=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        shards=2,
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)
