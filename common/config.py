"""Configuration schemas, one frozen dataclass per concern: engine, speculation, roles, logging,
`pdserve up` (the router's are in common/router_options.py).

Each field is one command-line flag (pdserve/flags.py generates them, with the field's help) and
one environment variable, PDSERVE_<FLAG_NAME> (--max-running -> PDSERVE_MAX_RUNNING). `aliases`
are SGLang's names for the same setting. Torch-free: the router's flags come from here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from common.defaults import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_BOOTSTRAP_TIMEOUT,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_CONNECT_ATTEMPTS,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DECODE_MAX_RUNNING,
    DEFAULT_GRAMMAR_BACKEND,
    DEFAULT_GRAPH_MAX_BS,
    DEFAULT_PROMPT_GRAPH_TOKENS,
    DEFAULT_STREAM_MESSAGES_PER_S,
    DEFAULT_SWITCH_INTERVAL_MS,
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_LOCAL_PREFILL_TPOT_MS,
    DEFAULT_MAX_RUNNING,
    DEFAULT_MEM_FRACTION_STATIC,
    DEFAULT_PAGE_SIZE,
    DEFAULT_TP_SIZE,
    DEFAULT_TP_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT,
    DEFAULT_WAITING_TIMEOUT,
)
from common.flag_fields import opt

ENV_PREFIX = "PDSERVE_"
PANEL_SPEC = "Speculative decoding"
PANEL_EAGLE = "Speculative decoding: EAGLE"
PANEL_NGRAM = "Speculative decoding: n-gram"
PANEL_FAST = "GPU fast path"
PANEL_TP = "Tensor parallelism"


HOST_HELP = "Address to bind (0.0.0.0: every interface, as a pod needs)."
_MODEL_HELP = "HF-format model directory (default: the built-in Python-code pair, with EAGLE on)."


@dataclass(frozen=True)
class EngineOptions:
    """What a node's engine loads and how it batches (every role's engine flags)."""

    model: Optional[Path] = opt(None, _MODEL_HELP, aliases=("--model-path",))
    served_model_name: Optional[str] = opt(
        None, "Model id the node reports to the router (default: the model directory's name)."
    )
    dtype: Optional[str] = opt(None, "float32, bfloat16 or float16.")
    device: str = opt("auto", "torch device: auto (cuda:0 when a GPU is present, else cpu), cpu or cuda:N.")
    page_size: int = opt(DEFAULT_PAGE_SIZE, "Tokens per KV cache page.")
    max_total_tokens: Optional[int] = opt(
        None,
        "KV cache capacity in tokens (default: what --mem-fraction-static leaves on a GPU; 16384 on a CPU, "
        "where a share of host memory means nothing).",
    )
    mem_fraction_static: float = opt(
        DEFAULT_MEM_FRACTION_STATIC,
        "Share of the GPU's total memory for weights + KV cache, in (0, 1]; the rest "
        "is left for activations and CUDA graphs. Sizes the KV cache when --max-total-tokens is not given.",
    )
    max_running: Optional[int] = opt(
        None,
        f"Most requests in flight (default: {DEFAULT_MAX_RUNNING}; {DEFAULT_DECODE_MAX_RUNNING} on a decode node, "
        "whose steps carry no prompts beside its TPOT guard's chunks).",
        aliases=("--max-running-requests",),
    )
    chunked_prefill_size: int = opt(DEFAULT_CHUNKED_PREFILL_SIZE, "Prefill token budget per step (chunked prefill).")
    disable_radix_cache: bool = opt(
        False,
        "Keep no prefix cache: every prompt is computed whole (by default finished requests' KV "
        "pages are kept by token prefix, reused by later requests, and evicted when space is needed).",
        negatable=False,
    )
    attention_backend: str = opt(
        "auto",
        "Attention backend: auto (triton on GPUs, torch on CPU), torch, or triton.",
        panel=PANEL_FAST,
    )
    overlap: Optional[bool] = opt(None, "Overlap scheduling (default: on for GPUs, off on CPU).", panel=PANEL_FAST)
    cuda_graph_max_bs: Optional[int] = opt(
        None,
        "Largest batch served from CUDA graphs; 0 disables "
        f"(default: min(max-running, {DEFAULT_GRAPH_MAX_BS}) on GPUs).",
        panel=PANEL_FAST,
    )
    cuda_graph_prompt_tokens: int = opt(
        DEFAULT_PROMPT_GRAPH_TOKENS,
        "Prompt batches of at most this many tokens (buckets up to 2048) and 8 requests replay CUDA graphs "
        "captured at token buckets (short prompts are launch-bound; a loaded prefill node's long ones can be "
        "too); 0 disables. Needs --cuda-graph-max-bs > 0.",
        panel=PANEL_FAST,
    )
    disable_mixed_chunk: bool = opt(
        False,
        "Run a node's prompt chunks as forwards of their own between its decode steps. By default a node "
        "under a TPOT guard (a decode node running prompts itself, --local-prefill-tpot-ms) runs each chunk "
        "inside a decode step, one forward reading the weights once for both (plain decoding; on two H100s "
        "PD's goodput was no lower with it on any workload and SLO, and higher on three, bench/RESULTS.md).",
        negatable=False,
        panel=PANEL_FAST,
    )
    switch_interval_ms: Optional[float] = opt(
        DEFAULT_SWITCH_INTERVAL_MS,
        "How long a thread of the node process may hold the GIL while another waits for it "
        "(sys.setswitchinterval; Python's is 5 ms). The scheduler thread lets go of it while it waits for "
        "the device and takes it back from the event loop that streams tokens and serves gRPC; on a "
        "decode node streaming a few hundred requests, Python's 5 ms stretched each step by several ms "
        "(bench/stream_overhead.py).",
        panel=PANEL_FAST,
    )
    stream_interval: str = opt(
        "auto",
        "Tokens a streamed response message gathers after its first (SGLang's --stream-interval), or auto: "
        "the router relays every message on one event loop, so at high rates fewer, larger messages let it "
        "carry more streams, while clients get tokens in groups. auto sends a token a message until the node "
        "streams more tokens a second than --stream-messages-per-s, then as many as keep within it (at most "
        "16). The first token and the end go out at once.",
        panel=PANEL_FAST,
    )
    stream_messages_per_s: float = opt(
        DEFAULT_STREAM_MESSAGES_PER_S,
        "--stream-interval auto's message budget per node: a router relays a message in about 0.1 ms of "
        "its one core (bench/router_paced.py). A router also paces every stream it relays together, within "
        "its own --stream-messages-per-s, by asking new requests for more tokens a message.",
        panel=PANEL_FAST,
    )
    warmup: Optional[bool] = opt(
        None,
        "Run synthetic prompts of each length before serving: kernels compile then, and the prompt "
        "rate the router reads is measured warm (default: on for GPUs, off on CPU).",
        panel=PANEL_FAST,
    )
    future_map_debug: bool = opt(
        False, "FutureMap debug mode: poison consumed rows and check every read.", panel=PANEL_FAST
    )
    grammar_backend: str = opt(
        DEFAULT_GRAMMAR_BACKEND,
        "Grammar library for constrained output (response_format, regex, ebnf, structural tags): "
        "llguidance or xgrammar (bench/RESULTS.md compares them).",
    )
    tp_size: int = opt(
        DEFAULT_TP_SIZE,
        "Tensor-parallel ranks, one process and one GPU each: cuda:i..cuda:i+N-1 from --device cuda:i "
        "(or every rank on the CPU over gloo). Prefill and decode nodes of different sizes pair.",
        aliases=("--tensor-parallel-size",),
        panel=PANEL_TP,
    )
    tp_timeout_s: float = opt(
        DEFAULT_TP_TIMEOUT_S,
        "Seconds a collective between ranks may take before the node is failed (NOT_SERVING) instead of hanging.",
        panel=PANEL_TP,
    )

    def for_role(self, role: str) -> EngineOptions:
        """These options with the role's defaults filled in (a decode node runs a larger batch)."""
        if self.max_running is not None:
            return self
        default = DEFAULT_DECODE_MAX_RUNNING if role == "decode" else DEFAULT_MAX_RUNNING
        return dataclasses.replace(self, max_running=default)

    def fast_path(self) -> dict[str, Any]:
        """EngineConfig fields of the GPU fast path: Triton attention, overlap and CUDA graphs by
        default on GPUs; the CPU keeps the torch reference path (nothing to overlap or capture)."""
        if self.device == "auto":  # the choice depends on the device: pdserve/build.py resolves it first
            raise ValueError("device 'auto' must be resolved to cpu or cuda:N before choosing the fast path")
        gpu = self.device.startswith("cuda")
        backend = self.attention_backend if self.attention_backend != "auto" else ("triton" if gpu else "torch")
        graphs = (
            self.cuda_graph_max_bs
            if self.cuda_graph_max_bs is not None
            else (min(self.max_running or DEFAULT_MAX_RUNNING, DEFAULT_GRAPH_MAX_BS) if gpu else 0)
        )
        return {
            "attention_backend": backend,
            "overlap": gpu if self.overlap is None else self.overlap,
            "cuda_graph_max_bs": graphs,
            "cuda_graph_prompt_tokens": self.cuda_graph_prompt_tokens if graphs > 0 else 0,
            "future_map_debug": self.future_map_debug,
            "prompt_warmup": gpu if self.warmup is None else self.warmup,
        }


@dataclass(frozen=True)
class SpeculativeOptions:
    """The --speculative-* flags; unset (None) ones take spec.config.SpecConfig's defaults."""

    algorithm: Optional[str] = opt(
        None,
        "NONE, EAGLE, EAGLE3 or a registered plugin such as NGRAM (case-insensitive; default: EAGLE "
        "with the built-in pair, else NONE).",
        panel=PANEL_SPEC,
    )
    num_steps: Optional[int] = opt(None, "Draft steps per verify (default 3).", panel=PANEL_SPEC)
    num_draft_tokens: Optional[int] = opt(
        None,
        "Tokens per verify, root included (default: num_steps + 1 for a chain, more for a tree).",
        panel=PANEL_SPEC,
    )
    adaptive: bool = opt(
        False, "Adapt the draft steps to the batch size and the acceptance seen (EAGLE chains).", panel=PANEL_SPEC
    )
    adaptive_config: Optional[Path] = opt(
        None,
        "JSON of candidate steps per batch-size range (default: the built-in one; spec/adaptive).",
        panel=PANEL_SPEC,
    )
    draft_model_path: Optional[Path] = opt(
        None, "Draft head directory (HF format), needed by EAGLE and EAGLE3.", panel=PANEL_EAGLE
    )
    eagle_topk: Optional[int] = opt(
        None, "Branches per draft step; 1 is a chain, more is a tree (default 1).", panel=PANEL_EAGLE
    )
    ngram_min: Optional[int] = opt(None, "NGRAM: shortest suffix to look up (default 1).", panel=PANEL_NGRAM)
    ngram_max: Optional[int] = opt(None, "NGRAM: longest suffix to look up (default 4).", panel=PANEL_NGRAM)

    def given(self) -> dict[str, Any]:
        """The options set on the command line (algorithm aside), as SpecConfig fields."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "algorithm"}
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in out.items() if v is not None and v is not False}

    def argv(self) -> list[str]:
        """These options as flags again (`pdserve up` hands them to its nodes)."""
        args: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            name = "--speculative-" + f.name.replace("_", "-")
            if value is True:
                args.append(name)
            elif value is not None and value is not False:
                args += [name, str(value)]
        return args


@dataclass(frozen=True)
class ServeRole:
    """`pdserve serve`: a colocated node (prompt and decode in one process)."""

    host: str = opt("127.0.0.1", HOST_HELP)
    port: int = opt(30000, "Scheduler API (gRPC) port.")
    metrics_port: Optional[int] = opt(None, "Serve Prometheus /metrics on this port (0: any free).")


_SGL_HELP = (
    "Post each KV write as one scatter-gather list (NIXL's UCX SGL offload; on GPUs one batched "
    "copy instead of one per layer and K|V): on, off, or auto (the default: on where the KV is in GPU "
    "memory, where a decode node's fragmented pages made a copy per descriptor 3-5x slower)."
)

_ROWS_HELP = (
    "Where the handoff rows (first token, draft state) live: kv (beside the KV cache; in GPU "
    "memory a request's row rides in its pages' NIXL transfer) or host (host memory: a second "
    "transfer stage after the pages)."
)


@dataclass(frozen=True)
class PrefillRole:
    """`pdserve prefill`: runs prompts and writes their KV to decode nodes."""

    host: str = opt("127.0.0.1", HOST_HELP)
    port: int = opt(30001, "Scheduler API (gRPC) port.")
    bootstrap_port: int = opt(
        DEFAULT_BOOTSTRAP_PORT, "KV control port decode nodes connect to.", aliases=("--disaggregation-bootstrap-port",)
    )
    kv_transport: str = opt("nixl", "KV transfer backend (nixl).", aliases=("--disaggregation-transfer-backend",))
    bootstrap_timeout: float = opt(DEFAULT_BOOTSTRAP_TIMEOUT, "Seconds to wait for a destination.")
    transfer_timeout: float = opt(DEFAULT_TRANSFER_TIMEOUT, "Seconds a KV write may take.")
    kv_handoff_rows: str = opt("kv", _ROWS_HELP)
    kv_write_sgl: str = opt("auto", _SGL_HELP)
    kv_send_chunks: bool = opt(
        True,
        "With chunked prefill, write each finished chunk's KV while the "
        "next chunk runs (off: one write once the whole prompt is done).",
    )
    local_decode_tpot_ms: float = opt(
        0.0,
        "Requests sent here without a decode node (the router's whole path, taken when the decode "
        "tier is at its TPOT budget) run here from prompt to last token, keeping them within this "
        "time per output token while prompts run beside them; 0 (the default) refuses them.",
    )
    metrics_port: Optional[int] = opt(None, "Serve Prometheus /metrics on this port (0: any free).")


@dataclass(frozen=True)
class DecodeRole:
    """`pdserve decode`: receives KV from prefill nodes and generates."""

    host: str = opt("127.0.0.1", HOST_HELP)
    port: int = opt(30002, "Scheduler API (gRPC) port.")
    kv_transport: str = opt("nixl", "KV transfer backend (nixl).", aliases=("--disaggregation-transfer-backend",))
    kv_handoff_rows: str = opt("kv", _ROWS_HELP)
    waiting_timeout: float = opt(DEFAULT_WAITING_TIMEOUT, "Seconds to wait for a prefill's KV.")
    connect_attempts: int = opt(DEFAULT_CONNECT_ATTEMPTS, "Handshake attempts per prefill.")
    connect_timeout: float = opt(DEFAULT_CONNECT_TIMEOUT, "Total seconds to reach a prefill.")
    heartbeat_interval: float = opt(DEFAULT_HEARTBEAT_INTERVAL, "Seconds between prefill health checks.")
    local_prefill_tpot_ms: float = opt(
        DEFAULT_LOCAL_PREFILL_TPOT_MS,
        "Prompts sent here without a prefill (the router's local path) run in chunks between decode "
        "steps, keeping running requests within this time per output token; 0 refuses them.",
    )
    metrics_port: Optional[int] = opt(None, "Serve Prometheus /metrics on this port (0: any free).")


@dataclass(frozen=True)
class LogOptions:
    """Logging of the long-running processes (nodes and router), on stderr."""

    log_level: str = opt("info", "debug, info, warning or error.")
    log_format: str = opt(
        "text",
        "text, or json: one object per line with time, level, logger, message and the "
        "request_id of the request the line concerns.",
    )


@dataclass(frozen=True)
class UpOptions:
    """`pdserve up`: a local deployment of router and nodes."""

    model: Optional[Path] = opt(None, _MODEL_HELP, aliases=("--model-path",))
    host: str = opt("127.0.0.1", HOST_HELP)
    port: int = opt(8000, "Router HTTP port (OpenAI API).")
    prefill: int = opt(1, "Number of prefill nodes.")
    decode: int = opt(1, "Number of decode nodes.")
    colocated: int = opt(0, "Run this many colocated nodes instead of prefill/decode (the PD baseline).")
    device: str = opt("auto", "auto (GPUs when present), cpu or cuda.")
    isolate_gpus: bool = opt(
        True,
        "Each node sees only its own GPU (CUDA_VISIBLE_DEVICES). --no-isolate-gpus: every node sees "
        "every GPU and gets --device cuda:N, which PD needs for GPU-to-GPU KV copies (CUDA IPC over NVLink).",
    )
    pd_prefill_policy: str = opt(
        "remote",
        "Where the router runs each prompt (PD only): remote (the prefill node), local (the decode node) "
        "or auto (whichever starts it sooner, from the nodes' measured rates).",
    )
    tp_size: int = opt(
        DEFAULT_TP_SIZE,
        "Tensor-parallel ranks per node: node k's ranks on GPUs k*N .. k*N+N-1 (refused when the machine "
        "has fewer). Prefill, decode and colocated nodes alike.",
        aliases=("--tensor-parallel-size",),
    )
    local_prefill_tpot_ms: Optional[float] = opt(
        None,
        "Decode nodes' TPOT guard for the prompts they run themselves (their --local-prefill-tpot-ms; "
        "default: theirs). Under auto, keep it below the TPOT you promise.",
    )
    local_decode_tpot_ms: Optional[float] = opt(
        None,
        "Prefill nodes' TPOT guard for the requests they run whole when the decode tier is at its TPOT "
        "budget (their --local-decode-tpot-ms; default: theirs, 0: never; with --pd-pooling, the decode "
        "nodes' guard). Needs --pd-prefill-policy auto.",
    )
    pd_pooling: str = opt(
        "off",
        "The router's --pd-pooling: auto falls back to colocated execution (every node serves whole "
        "requests) while the decode tier is what the load exhausts; always, throughout; off, never. "
        "Needs --pd-prefill-policy auto.",
    )
    pd_mixed_remote_ttft_target_ms: Optional[float] = opt(
        None, "The router's --pd-mixed-remote-ttft-target-ms (default: the router's). PD under auto only."
    )
    verbose: bool = opt(False, "Echo the nodes' logs.", negatable=False)


@dataclass(frozen=True)
class GenerateOptions:
    """`pdserve generate`: prompts, sampling and the in-process engine's settings."""

    prompt: list[str] = opt(..., "Prompt text; repeat for a batch (one prompt streams).", aliases=("-p",))
    model: Optional[Path] = opt(
        None, "HF-format model directory (default: the built-in Python-code pair, EAGLE on).", aliases=("--model-path",)
    )
    max_new_tokens: int = opt(64, "Tokens to generate per prompt.")
    temperature: float = opt(1.0, "0 means greedy.")
    top_p: float = opt(1.0, "Nucleus sampling mass, in (0, 1].")
    top_k: int = opt(-1, "Keep the k most likely tokens; -1 is off.")
    min_p: float = opt(0.0, "Drop tokens below min_p * max prob.")
    seed: Optional[int] = opt(None, "Seed for reproducible sampling.")
    stop: list[str] = opt([], "Stop string (repeatable); the output ends before it.")
    dtype: Optional[str] = opt(None, "float32, bfloat16 or float16 (default: the checkpoint's).")
    device: str = opt("cpu", "torch device, e.g. cpu or cuda.")
    page_size: int = opt(DEFAULT_PAGE_SIZE, "Tokens per KV cache page.")
    chat: bool = opt(False, "Wrap each prompt as a user message with the chat template.", negatable=False)
