"""Load HF-format checkpoints (config.json + safetensors, single file or sharded) into our models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from common.tp_layout import TpLayout, TpLayoutError
from engine.config import ModelConfig, ModelLoadError, parse_dtype
from engine.models import model_class
from engine.parallel.group import SINGLE, TpGroup
from engine.parallel.shard_plan import ShardPlan


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: malformed index ({e})") from e
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: lists shard {f.name} which does not exist")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    return found


def iter_tensors(files: list[Path], plan: ShardPlan | None = None) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Every tensor of the checkpoint; with a tensor-parallel `plan`, only this rank's slice of
    the sharded ones is read from the file."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    cut = plan.slice_of(name) if plan is not None else None
                    if cut is None:
                        yield f, name, st.get_tensor(name)
                        continue
                    index = (slice(None),) * cut.dim + (slice(cut.start, cut.stop),)
                    yield f, name, st.get_slice(name)[index]
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors ({e})") from e


def load_weights(
    model: nn.Module,
    files: list[Path],
    ignore_prefixes: tuple[str, ...] = (),
    rename: dict[str, str] | None = None,
    buffers: tuple[str, ...] = ("d2t", "t2d"),
    plan: ShardPlan | None = None,
) -> None:
    """Copy checkpoint tensors into `model`; every parameter must be found with its exact shape
    (its rank's slice under tensor parallelism, where a vocabulary block may be padded)."""
    params = dict(model.named_parameters())
    tied = getattr(model, "tied_parameter_names", lambda: set())()
    missing = set(params) - tied
    rename = rename or {}
    for f, name, tensor in iter_tensors(files, plan):
        name = rename.get(name, name)
        if name.startswith(ignore_prefixes) or name.endswith("rotary_emb.inv_freq") or name in buffers:
            continue
        if name not in params:
            if name in tied:
                continue
            raise ModelLoadError(f"{f}: unexpected tensor {name!r} (not a parameter of {type(model).__name__})")
        p = params[name]
        target = p
        if plan is not None and plan.padded(name) and 0 < tensor.shape[0] < p.shape[0]:
            with torch.no_grad():  # the last vocabulary block runs short: zero padding rows
                p[tensor.shape[0] :].zero_()
            target = p[: tensor.shape[0]]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(p.dtype))
        missing.discard(name)
    if missing:
        raise ModelLoadError(
            f"{files[0].parent}: missing tensors {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}"
        )


def build_empty(
    cls: Callable[..., nn.Module], cfg: Any, dtype: torch.dtype, device: torch.device | str, tp: TpGroup = SINGLE
) -> nn.Module:
    """Instantiate without initialising weights (meta device), then materialise on `device`
    (a tensor-parallel rank builds only its share)."""
    with torch.device("meta"):
        model = cls(cfg, tp) if tp.size > 1 else cls(cfg)
    model = model.to_empty(device=device)
    for p in model.parameters():  # floating parameters only: buffers such as d2t keep their dtype
        p.data = p.data.to(dtype)
    for m in model.modules():
        init = getattr(m, "init_buffers", None)
        if callable(init):
            init()
    if getattr(cfg, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty breaks the tie
    return model


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tp: TpGroup = SINGLE,
) -> tuple[nn.Module, ModelConfig]:
    """The model in `model_dir`, whole, or this rank's share of it under tensor parallelism."""
    path = Path(model_dir)
    cfg = ModelConfig.from_dir(path)
    torch_dtype = parse_dtype(dtype or cfg.torch_dtype)
    files = checkpoint_files(path)
    layout = tp_layout(cfg, tp)
    model = build_empty(model_class(cfg), cfg, torch_dtype, device, tp)
    load_weights(model, files, plan=ShardPlan(layout, cfg.head_dim) if tp.size > 1 else None)
    merge_projections_on_gpu(model, device)
    model.eval()
    return model, cfg


def tp_layout(cfg: ModelConfig, tp: TpGroup) -> TpLayout:
    """This rank's share of `cfg`; a model that cannot split this way is a load error naming why."""
    try:
        return tp.layout(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)
    except TpLayoutError as e:
        raise ModelLoadError(f"{cfg.architecture}: {e}") from None


def merge_projections_on_gpu(model: nn.Module, device: torch.device | str) -> None:
    """One GEMM for q/k/v and one for gate/up on GPUs (fewer, larger kernels per layer); the CPU
    reference keeps separate projections so its numerics stay those of the checkpoint's layout."""
    if torch.device(device).type == "cuda":
        from engine.models.llama import fuse_projections

        fuse_projections(model)


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks of real shapes without a checkpoint."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
