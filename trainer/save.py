"""Write the trained pair as HF-format directories (bf16 safetensors, configs, tokenizer files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trainer.layers import LlamaShape, hf_llama_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_FILE_BYTES = 15_000_000  # per saved file
_METADATA = {"format": "pt"}  # transformers expects this marker on torch-written files


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def save_weights(out: Path, tensors: dict[str, torch.Tensor], max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """One model.safetensors, or as many shards as keep each under `max_file_bytes` + an index."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards = max(1, -(-total // int(max_file_bytes * 0.95)))  # headroom for the safetensors header
    if shards == 1:
        _save(tensors, out / "model.safetensors")
        return
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    used, s = 0, 0
    for name, t in tensors.items():  # contiguous runs in order, cut at equal byte marks
        if used >= (s + 1) * total / shards and s < shards - 1:
            s += 1
        groups[s][name] = t
        used += t.numel() * t.element_size()
    weight_map = {}
    for i, part in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        _save(part, out / fname)
        weight_map.update({n: fname for n in part})
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata=_METADATA)
    path.chmod(0o644)  # safetensors writes 0600; servers often run as another user


def save_target(
    out: Path, shape: LlamaShape, tensors: dict[str, torch.Tensor], tok_dir: Path, ids: dict[str, int]
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "config.json",
        hf_llama_config(
            shape, arch="LlamaForCausalLM", bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], tied=True
        ),
    )
    write_json(
        out / "generation_config.json",
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"], "do_sample": False},
    )
    _copy_tokenizer(tok_dir, out)
    save_weights(out, tensors)


def save_head(out: Path, shape: LlamaShape, tensors: dict[str, torch.Tensor], ids: dict[str, int]) -> None:
    """The EAGLE-1 layout engine/draft_loader.py reads: fc + layers.0, no embedding, no LM head.
    No tokenizer files: the head uses its target's, and they would eat the size budget."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_llama_config(
        shape, arch="LlamaForCausalLMEagle", bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], tied=True
    )
    write_json(out / "config.json", cfg)
    save_weights(out, tensors)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if src.resolve() == dst.resolve():
        return
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, dst / name)


def file_sizes(root: Path) -> dict[str, int]:
    """Bytes of every file under `root`, by relative path."""
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
