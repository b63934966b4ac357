"""Load EAGLE / EAGLE-3 draft heads from HF-format dirs and check that they fit the target."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig, ModelLoadError, parse_dtype
from engine.loader import build_empty, checkpoint_files, iter_tensors, load_weights, merge_projections_on_gpu
from engine.models.eagle import EAGLE3_ARCHITECTURES, EAGLE_ARCHITECTURES, Eagle3Head, EagleHead, eagle3_aux_layers

DRAFT_FORMATS = ("eagle", "eagle3")


def _keys(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                keys.update(st.keys())
        except Exception as e:  # noqa: BLE001 - any read failure is a load error naming the file
            raise ModelLoadError(f"{f}: cannot read safetensors ({e})") from e
    return keys


def load_draft_model(
    model_dir: str | Path,
    fmt: str,
    target: nn.Module,
    target_cfg: ModelConfig,
    dtype: str | torch.dtype,
    device: torch.device | str,
) -> tuple[nn.Module, ModelConfig, tuple[int, ...]]:
    """Returns (head, head config, target layers to capture for it)."""
    if fmt not in DRAFT_FORMATS:
        raise ValueError(f"unknown draft format {fmt!r}; expected one of {DRAFT_FORMATS}")
    path = Path(model_dir)
    archs = EAGLE_ARCHITECTURES if fmt == "eagle" else EAGLE3_ARCHITECTURES
    cfg = ModelConfig.from_dir(path, architectures=archs)
    files = checkpoint_files(path)
    keys = _keys(files)
    torch_dtype = parse_dtype(dtype)
    if fmt == "eagle":
        head, aux = _eagle(cfg, keys, target_cfg, torch_dtype, device), ()
    else:
        head, aux = _eagle3(cfg, path, keys, target_cfg, torch_dtype, device)
    load_weights(head, files, ignore_prefixes=("lm_head.",) if fmt == "eagle" else ())
    merge_projections_on_gpu(head, device)
    if fmt == "eagle3":
        _load_vocab_maps(head, files, target_cfg)
    head.attach_target(target)
    head.eval()
    return head, cfg, aux


def _eagle(
    cfg: ModelConfig, keys: set[str], target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> nn.Module:
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ModelLoadError(
            f"EAGLE head hidden_size {cfg.hidden_size} does not fit the target's {target_cfg.hidden_size}"
        )
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ModelLoadError(
            f"EAGLE head vocab_size {cfg.vocab_size} does not fit the target's "
            f"{target_cfg.vocab_size} (it shares the target's LM head)"
        )
    flags = dict(
        fc_bias="fc.bias" in keys,
        input_norm="layers.0.input_layernorm.weight" in keys,
        own_embedding="embed_tokens.weight" in keys,
    )
    return build_empty(lambda c: EagleHead(c, **flags), cfg, dtype, device)


def _eagle3(
    cfg: ModelConfig,
    path: Path,
    keys: set[str],
    target_cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[nn.Module, tuple[int, ...]]:
    draft_vocab = int(cfg.raw.get("draft_vocab_size") or cfg.vocab_size)
    own_embedding = "embed_tokens.weight" in keys
    if not own_embedding and cfg.hidden_size != target_cfg.hidden_size:
        raise ModelLoadError(
            f"EAGLE-3 head hidden_size {cfg.hidden_size} needs its own embedding to "
            f"differ from the target's {target_cfg.hidden_size}"
        )
    if draft_vocab > target_cfg.vocab_size:
        raise ModelLoadError(
            f"EAGLE-3 draft_vocab_size {draft_vocab} exceeds the target vocabulary {target_cfg.vocab_size}"
        )
    if own_embedding and cfg.vocab_size != target_cfg.vocab_size:
        raise ModelLoadError(
            f"EAGLE-3 head vocab_size {cfg.vocab_size} does not fit the target's {target_cfg.vocab_size}"
        )
    kw = dict(
        target_hidden_size=target_cfg.hidden_size,
        draft_vocab_size=draft_vocab,
        target_vocab_size=target_cfg.vocab_size,
        own_embedding=own_embedding,
    )
    head = build_empty(lambda c: Eagle3Head(c, **kw), cfg, dtype, device)
    eagle_cfg = cfg.raw.get("eagle_config") or {}
    aux = eagle3_aux_layers(target_cfg.num_layers, eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
    return head, aux


def _load_vocab_maps(head: nn.Module, files: list[Path], target_cfg: ModelConfig) -> None:
    """d2t/t2d are buffers, not parameters; load and validate them explicitly."""
    found = {name: t for _, name, t in iter_tensors(files) if name in ("d2t", "t2d")}
    if "d2t" not in found:
        raise ModelLoadError(f"{files[0]}: EAGLE-3 checkpoint lacks the 'd2t' draft->target map")
    d2t = found["d2t"].to(torch.int64)
    if d2t.shape != head.d2t.shape:
        raise ModelLoadError(f"{files[0]}: tensor 'd2t' has shape {tuple(d2t.shape)}, expected {tuple(head.d2t.shape)}")
    target_ids = torch.arange(d2t.numel()) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= target_cfg.vocab_size:
        raise ModelLoadError(
            f"{files[0]}: 'd2t' maps draft tokens outside the target vocabulary (size {target_cfg.vocab_size})"
        )
    head.d2t.copy_(d2t)
    if "t2d" in found:
        head.t2d.copy_(found["t2d"].to(torch.bool))
    else:  # derivable: the target ids some draft id maps to
        head.t2d.zero_()
        head.t2d[target_ids.to(head.t2d.device)] = True
