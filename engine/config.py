"""Model and engine configuration: the HF config.json normalised, plus the engine's own knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.defaults import (
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_GRAMMAR_BACKEND,
    DEFAULT_MAX_RUNNING,
    DEFAULT_MEM_FRACTION_STATIC,
    DEFAULT_PAGE_SIZE,
    GRAMMAR_BACKENDS,
    DEFAULT_TP_SIZE,
    DEFAULT_TP_TIMEOUT_S,
)
from engine.mixed_graphs import CHUNK_TOKEN_BUCKETS

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float": torch.float32,
}


class ModelLoadError(RuntimeError):
    """A model directory that cannot be loaded; the message names the file and, where known, the tensor."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16") from None


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF config.json the engine uses, with family defaults filled in."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @staticmethod
    def from_dir(model_dir: str | Path, architectures: tuple[str, ...] = SUPPORTED_ARCHITECTURES) -> "ModelConfig":
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelLoadError(f"model directory {str(path)!r} does not exist or is not a directory")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{cfg_file}: missing config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{cfg_file}: expected a JSON object")
        return ModelConfig.from_hf(raw, source=str(cfg_file), architectures=architectures)

    @staticmethod
    def from_hf(
        raw: dict[str, Any], source: str = "config.json", architectures: tuple[str, ...] = SUPPORTED_ARCHITECTURES
    ) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in architectures:
            raise ModelLoadError(f"{source}: unsupported architecture {arch!r}; supported: {', '.join(architectures)}")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return ModelConfig(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(
                    raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
                ),
                rope_scaling=_rope_scaling(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=arch.startswith("Qwen2") or bool(raw.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                eos_token_ids=eos_ids,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                raw=raw,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: malformed field ({e})") from e


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """Rope scaling from either the classic `rope_scaling` or the newer `rope_parameters` key."""
    rs = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ModelLoadError(f"config.json: unsupported rope_scaling type {kind!r} (supported: llama3)")
    return dict(rs, rope_type="llama3")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance; every field has a safe CPU default."""

    model: str
    dtype: str | None = None  # default: the checkpoint's torch_dtype
    device: str = "cpu"
    page_size: int = DEFAULT_PAGE_SIZE
    # KV capacity in tokens (rounded down to whole pages). None: sized from mem_fraction_static on
    # GPUs (engine/kv_budget.py), kv_budget.CPU_KV_TOKENS on a CPU. A fixed default here keeps
    # scripts and tests that hold several engines in one process from each claiming the device.
    max_total_tokens: int | None = 16384
    mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC  # share of the device for weights + KV
    max_running: int = DEFAULT_MAX_RUNNING
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    max_context_len: int | None = None  # default: the model's max_position_embeddings
    attention_backend: str = "torch"
    seed: int | None = None  # seeds the draw of per-request seeds for unseeded requests
    # Overlap scheduling: form and launch batch N+1 while batch N runs, process results one
    # step late. Off by default: on CPU the "device" work runs synchronously inside the launch,
    # so there is nothing to hide; GPU deployments and the GPU benchmark turn it on. Executors
    # that cannot overlap (host-side drafting) run synchronously whatever this says.
    overlap: bool = False
    # FutureMap debug mode: poison consumed relay rows and check every read was written
    future_map_debug: bool = False
    # > 0 on CUDA: capture decode / verify / draft forwards in CUDA graphs up to this batch size
    cuda_graph_max_bs: int = 0
    # with cuda_graph_max_bs > 0 off CUDA: run those forwards through the graphs' padded static
    # buffers without capturing (the CPU test path of the graph code)
    cuda_graph_padded_eager: bool = False
    # with cuda_graph_max_bs > 0: prompt batches of at most this many tokens (and 8 requests) run
    # from graphs captured at token buckets (engine/prompt_graphs.py); 0: prompts run eagerly
    cuda_graph_prompt_tokens: int = 0
    # Running requests come first and prompt chunks alternate with decode steps, sized to keep
    # this time per output token (engine/scheduler/tpot_guard.py); a decode node running prompts
    # itself sets it. None: prompts first, in chunks of chunked_prefill_size.
    tpot_guard_ms: float | None = None
    # With a TPOT guard and a worker that can (plain decoding): a prompt chunk runs inside a decode
    # step, one forward for both (engine/mixed_graphs.py), so it costs its tokens and not a second
    # pass over the weights. Off (`--disable-mixed-chunk`): chunks alternate with decode steps.
    mixed_chunk: bool = True
    # Before serving, run synthetic prompts of each length class (engine/warmup.py): the prompt
    # path's kernel compiles are paid then, and the prompt rate is measured on warm kernels.
    prompt_warmup: bool = False
    # Keep finished requests' KV pages by token prefix and reuse them (engine/radix_cache.py);
    # off: every prompt is computed whole (`--disable-radix-cache`).
    radix_cache: bool = True
    # Tensor parallelism: ranks (one process and one GPU each; cuda:i..cuda:i+tp_size-1 from the
    # configured cuda:i, or all on the CPU over gloo), and the deadline after which a collective
    # that has not completed fails the node rather than hanging it.
    tp_size: int = DEFAULT_TP_SIZE
    tp_timeout_s: float = DEFAULT_TP_TIMEOUT_S
    # the library constrained output is compiled and matched with (engine/grammar: llguidance or xgrammar)
    grammar_backend: str = DEFAULT_GRAMMAR_BACKEND

    def __post_init__(self) -> None:
        for name in ("page_size", "max_total_tokens", "max_running", "chunked_prefill_size", "tp_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tpot_guard_ms is not None and self.tpot_guard_ms < 0:
            raise ValueError(f"tpot_guard_ms must be >= 0, got {self.tpot_guard_ms}")
        check_fraction(self.mem_fraction_static)
        check_device(self.device)
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")


def mixed_chunk_tokens(config: EngineConfig) -> int | None:
    """The largest prompt chunk a mixed batch carries (None: the node does not mix): the mixed
    graphs' largest when graphs are on, so every mixed step replays one."""
    if not (config.mixed_chunk and config.tpot_guard_ms):
        return None
    if config.cuda_graph_max_bs > 0 and config.cuda_graph_prompt_tokens > 0:
        return min(config.cuda_graph_prompt_tokens, config.chunked_prefill_size, CHUNK_TOKEN_BUCKETS[-1])
    return config.chunked_prefill_size


def mixed_chunk_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The chunk sizes a mixed chunk is cut to when the prompt needs more than the guard allows:
    the mixed graphs' chunk buckets up to the cap, so a step pays for no padded token and costs
    what the guard priced (empty: any size, when mixed batches run eagerly or not at all)."""
    cap = mixed_chunk_tokens(config)
    if cap is None or not (config.cuda_graph_max_bs > 0 and config.cuda_graph_prompt_tokens > 0):
        return ()
    return tuple(t for t in CHUNK_TOKEN_BUCKETS if t <= cap)


def check_device(name: str) -> torch.device:
    """Parse a device name and make sure this machine has it: a clear error naming the device, not
    a RuntimeError or an assert deep in model loading. The engine has CPU and CUDA paths only
    (DESIGN.md section 3); other torch backends would fail deep inside."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a valid torch device ({e}); use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {name!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available in this torch build or machine")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} does not exist ({torch.cuda.device_count()} CUDA device(s) present)")
    return dev


class KVBudgetError(ValueError):
    """The memory share cannot hold the KV cache; the message says what to change."""


def check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:
        raise KVBudgetError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
