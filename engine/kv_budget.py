"""KV cache sizing: how many tokens fit in the device memory the loaded weights leave.

SGLang's rule for `--mem-fraction-static`: weights plus KV cache may fill that share of the
device's total memory, and the rest stays free for activations, CUDA graphs and the allocator's
slack. On a CPU host memory is shared with everything else on the machine, so no fraction of it
means anything: the KV cache keeps a fixed default there unless `--max-total-tokens` says otherwise.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.config import KVBudgetError, ModelLoadError, check_fraction

log = logging.getLogger(__name__)

CPU_KV_TOKENS = 16384  # the KV capacity of a CPU engine not told otherwise
_GIB = 1 << 30


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """One token's K and V over every layer of one model."""
    return num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


def kv_cache_tokens(total_bytes: int, free_bytes: int, fraction: float, bytes_per_token: int, page_size: int) -> int:
    """Tokens of KV cache (whole pages) that fit in what the weights leave of `fraction` of the
    device; page 0 is never handed out, so it is paid for but not counted."""
    check_fraction(fraction)
    if bytes_per_token < 1 or page_size < 1:
        raise ValueError(f"bytes_per_token and page_size must be >= 1, got {bytes_per_token}, {page_size}")
    budget = free_bytes - int(total_bytes * (1 - fraction))
    pages = max(0, budget) // (bytes_per_token * page_size) - 1
    if pages < 1:
        raise KVBudgetError(
            f"no room for the KV cache: {free_bytes / _GIB:.2f} GiB free after loading the weights, of which "
            f"{(1 - fraction) * total_bytes / _GIB:.2f} GiB stay free for activations (1 - --mem-fraction-static "
            f"{fraction} of {total_bytes / _GIB:.2f} GiB); one page needs {bytes_per_token * page_size} bytes "
            "(and page 0 is reserved). Raise --mem-fraction-static or give --max-total-tokens"
        )
    return pages * page_size


def draft_footprint(model_dir: str | None, dtype_bytes: int) -> tuple[int, int]:
    """(KV bytes per token, weight bytes) of a draft model that keeps KV over the target's pages,
    read before it loads: its config.json, and its checkpoint's size for the weights (an estimate,
    in the checkpoint's dtype)."""
    if model_dir is None:
        return 0, 0
    root = Path(model_dir)
    cfg_file = root / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
        per_token = kv_bytes_per_token(
            int(raw["num_hidden_layers"]), int(raw.get("num_key_value_heads") or heads), head_dim, dtype_bytes
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{cfg_file}: cannot size the draft model's KV cache ({e!r})") from e
    return per_token, sum(f.stat().st_size for f in root.glob("*.safetensors"))


def size_kv_cache(
    device: torch.device, fraction: float, page_size: int, bytes_per_token: int, pending_weight_bytes: int = 0
) -> int:
    """KV capacity in tokens for a device whose target weights are loaded; `pending_weight_bytes`
    will load after the cache is allocated (a draft model) and so count as used already."""
    check_fraction(fraction)
    if device.type != "cuda":
        return CPU_KV_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    tokens = kv_cache_tokens(total, free - pending_weight_bytes, fraction, bytes_per_token, page_size)
    log.info(
        "KV cache: %d tokens (%.2f GiB) from --mem-fraction-static %s of %.1f GiB",
        tokens,
        tokens * bytes_per_token / _GIB,
        fraction,
        total / _GIB,
    )
    return tokens
