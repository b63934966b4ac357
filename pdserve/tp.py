"""Tensor-parallel flags checked before anything loads: sizes and the GPUs they need."""

from __future__ import annotations

from pathlib import Path


class TpSetupError(ValueError):
    """A --tp-size this node or deployment cannot run; the message says what to change."""


def check_tp_size(tp_size: int) -> None:
    if tp_size < 1:
        raise TpSetupError(f"--tp-size must be >= 1, got {tp_size}")


def check_tp_flags(tp_size: int, tp_timeout_s: float) -> None:
    check_tp_size(tp_size)
    if not tp_timeout_s > 0:
        raise TpSetupError(f"--tp-timeout-s must be > 0, got {tp_timeout_s:g}")


def check_gpus(device: str, tp_size: int, count: int) -> None:
    """Rank r runs on cuda:(i + r) from --device cuda:i: all of them must exist (`count` visible)."""
    if tp_size == 1 or not device.startswith("cuda"):
        return
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    last = first + tp_size - 1
    if last >= count:
        raise TpSetupError(
            f"--tp-size {tp_size} on {device} needs cuda:{first}..cuda:{last}, but {count} CUDA device(s) "
            f"are visible (cuda:0..cuda:{count - 1}); lower --tp-size or start from a lower --device"
        )


def check_model_split(model_dir: str | Path, tp_size: int) -> None:
    """The model's heads, KV heads, MLP columns divide over `tp_size` ranks (common/tp_layout.py's
    rules), read from its config.json: a model that cannot split fails now, not after loading."""
    if tp_size == 1:
        return
    from common.tp_layout import TpLayout, TpLayoutError
    from engine.config import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    try:
        TpLayout(0, tp_size, mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size)
    except TpLayoutError as e:
        raise TpSetupError(f"{Path(model_dir).name} cannot be split over --tp-size {tp_size}: {e}") from None


def gpus_per_node(tp_size: int, nodes: int, count: int) -> None:
    """`pdserve up`: node k takes GPUs k*tp_size .. (k+1)*tp_size-1; refuse when they are not there."""
    need = tp_size * nodes
    if tp_size > 1 and need > count:
        raise TpSetupError(
            f"--tp-size {tp_size} for {nodes} node(s) needs {need} GPUs (each node's ranks on GPUs of "
            f"their own), but this machine has {count}"
        )
