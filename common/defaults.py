"""Defaults and value checks shared by the flag schemas, the engine and the router (torch-free).

The CLI's schema module (common/config.py) builds its flags on top of these; the engine imports
them from here, never the schema, and so do the router's components that need a default.
"""

from __future__ import annotations

# Share of a GPU's memory that weights + KV cache may fill (SGLang's --mem-fraction-static); the
# rest is left for activations, CUDA graphs and the allocator's slack. A little below SGLang's usual
# ~0.88: graphs here are captured per speculative step count as well as per batch size (adaptive
# steps keep several sets), and under overlap scheduling two batches' activations are alive at once.
# On an 80 GB card 0.85 leaves 12 GB, far more than a 2048-token prefill chunk of an 8B model needs.
DEFAULT_MEM_FRACTION_STATIC = 0.85

# The KV control port a prefill node listens on and decode nodes dial, when none is named
# (SGLang's --disaggregation-bootstrap-port default, which SMG also assumes).
DEFAULT_BOOTSTRAP_PORT = 8998

# A node process's GIL switch interval (--switch-interval-ms), in ms. Its scheduler thread lets go
# of the GIL while it waits for the device and must take it back from the event loop, which may
# hold it this long while it streams. At Python's 5 ms, 200 streams at 60 us of loop time each held
# an 8 ms step at 14 ms; at 1 ms, 10 ms (bench/stream_overhead.py).
DEFAULT_SWITCH_INTERVAL_MS = 1.0
DEFAULT_PROMPT_PREFIX_CACHE_MB = 32.0  # the router's --prompt-prefix-cache-mb (router/prefix_tokens.py)
DEFAULT_STREAM_MESSAGES_PER_S = 3000.0  # --stream-interval auto's budget per node (common/stream_pacer.py)
# the router's --stream-messages-per-s: its budget over every stream it relays (router/attempt.py)
DEFAULT_ROUTER_STREAM_MESSAGES_PER_S = 3000.0

# The PD handoff's bounds, in seconds (prefill: --bootstrap-timeout, --transfer-timeout; decode:
# --waiting-timeout, --connect-attempts, --connect-timeout, --heartbeat-interval). A decode waits
# longer for KV than a prefill waits for a destination: the KV comes after the prompt's forward.
DEFAULT_BOOTSTRAP_TIMEOUT = 30.0
DEFAULT_TRANSFER_TIMEOUT = 30.0
DEFAULT_WAITING_TIMEOUT = 60.0
DEFAULT_CONNECT_ATTEMPTS = 8
DEFAULT_CONNECT_TIMEOUT = 30.0
DEFAULT_HEARTBEAT_INTERVAL = 2.0

# How an engine batches, unless told (--page-size, --max-running, --chunked-prefill-size).
DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_RUNNING = 64
# A decode node's batch: its steps carry no prompts (or only chunks its TPOT guard sizes), so it is
# bounded by its TPOT and KV, not by prompts sharing its steps. At 64, one decode GPU of an 8B model
# queued arrivals at an 11 ms TPOT while two colocated replicas held 128 (bench/RESULTS.md, goodput).
DEFAULT_DECODE_MAX_RUNNING = 256
# CUDA graphs are captured up to the batch the node runs, up to this (eager beyond)
DEFAULT_GRAPH_MAX_BS = 256
# prompt batches up to this many tokens (a chunked prefill's whole budget) replay bucketed CUDA
# graphs (engine/prompt_graphs.py): under load a 1,024-token batch launched eagerly took 29-37 ms of
# host time, from graphs 2.3 ms (two H200s, bench/RESULTS.md, goodput)
DEFAULT_PROMPT_GRAPH_TOKENS = 2048
DEFAULT_CHUNKED_PREFILL_SIZE = 2048

# The grammar libraries constrained output may be compiled and matched with (--grammar-backend).
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")
DEFAULT_GRAMMAR_BACKEND = "llguidance"

# Tensor parallelism (--tp-size, --tp-timeout-s): one rank by default, and how long a collective may
# take before the node is failed rather than left hanging. Generous: a first step under CUDA graph
# capture or a long prefill chunk of a large model must not trip it.
DEFAULT_TP_SIZE = 1
DEFAULT_TP_TIMEOUT_S = 120.0

# The router's flags whose defaults its components share, in seconds where a time. The first token
# is due later than the next ones: it waits for the prefill's forward and KV transfer too.
DEFAULT_PREFILL_TIMEOUT = 60.0
DEFAULT_FIRST_TOKEN_TIMEOUT = 90.0
DEFAULT_INTER_TOKEN_TIMEOUT = 60.0
DEFAULT_REFRESH_INTERVAL = 2.0
DEFAULT_BREAKER_FAILURES = 3
DEFAULT_BREAKER_COOLDOWN = 10.0
DEFAULT_MAX_QUEUE = 256


ROWS_PLACES = ("kv", "host")  # --kv-handoff-rows


def check_rows_place(place: str) -> str:
    """A --kv-handoff-rows value, or a ValueError naming the flag and the choices."""
    if place not in ROWS_PLACES:
        raise ValueError(f"--kv-handoff-rows must be one of {', '.join(ROWS_PLACES)}, got {place!r}")
    return place


SGL_MODES = ("off", "on", "auto")  # --kv-write-sgl


def check_sgl_mode(mode: str) -> str:
    """A --kv-write-sgl value, or a ValueError naming the flag and the choices."""
    if mode not in SGL_MODES:
        raise ValueError(f"--kv-write-sgl must be one of {', '.join(SGL_MODES)}, got {mode!r}")
    return mode


__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "DEFAULT_BREAKER_COOLDOWN",
    "DEFAULT_BREAKER_FAILURES",
    "DEFAULT_CHUNKED_PREFILL_SIZE",
    "DEFAULT_FIRST_TOKEN_TIMEOUT",
    "DEFAULT_INTER_TOKEN_TIMEOUT",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_MEM_FRACTION_STATIC",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_PREFILL_TIMEOUT",
    "DEFAULT_REFRESH_INTERVAL",
    "ROWS_PLACES",
    "SGL_MODES",
    "check_rows_place",
    "check_sgl_mode",
]

# A decode node runs prompts the router sends it without a prefill (its local path) in chunks
# alternating with decode steps, keeping its running requests within this time per output token.
DEFAULT_LOCAL_PREFILL_TPOT_MS = 25.0
# Where the router runs each PD prompt (router/prefill_path.py): the prefill node, the decode node,
# or whichever starts it sooner.
PD_PREFILL_POLICIES = ("remote", "local", "auto")


def check_pd_prefill_policy(value: str) -> str:
    if value not in PD_PREFILL_POLICIES:
        raise ValueError(f"--pd-prefill-policy must be one of {', '.join(PD_PREFILL_POLICIES)}, got {value!r}")
    return value


PD_POOLING_MODES = ("off", "auto", "always")  # the router's --pd-pooling (router/pooling.py)


def check_pd_pooling(mode: str, prefill_policy: str) -> str:
    """A known --pd-pooling mode, and one that the prefill path policy allows (pooling routes
    requests on the whole and local paths, which only `auto` takes)."""
    if mode not in PD_POOLING_MODES:
        raise ValueError(f"--pd-pooling must be one of {', '.join(PD_POOLING_MODES)}, got {mode!r}")
    if mode != "off" and prefill_policy != "auto":
        raise ValueError(f"--pd-pooling {mode} needs --pd-prefill-policy auto (got {prefill_policy})")
    return mode
