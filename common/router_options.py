"""The router's configuration schema (`pdserve router`): one flag and one PDSERVE_ variable per
field, as in common/config.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.config import HOST_HELP
from common.defaults import (
    DEFAULT_BREAKER_COOLDOWN,
    DEFAULT_BREAKER_FAILURES,
    DEFAULT_FIRST_TOKEN_TIMEOUT,
    DEFAULT_INTER_TOKEN_TIMEOUT,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_TIMEOUT,
    DEFAULT_PROMPT_PREFIX_CACHE_MB,
    DEFAULT_ROUTER_STREAM_MESSAGES_PER_S,
    DEFAULT_REFRESH_INTERVAL,
)
from common.flag_fields import opt


@dataclass(frozen=True)
class RouterOptions:
    """`pdserve router`: the OpenAI API in front of prefill/decode (and colocated) nodes."""

    host: str = opt("127.0.0.1", HOST_HELP)
    port: int = opt(8000, "HTTP port of the OpenAI API.")
    prefill: list[str] = opt([], "Prefill node HOST:PORT,BOOTSTRAP_PORT (repeatable).")
    decode: list[str] = opt([], "Decode node HOST:PORT (repeatable).")
    colocated: list[str] = opt([], "Colocated node HOST:PORT, used when no PD pair is available (repeatable).")
    prefill_policy: str = opt(
        "prefix_aware", "round_robin, least_load or prefix_aware (routes by the nodes' published prefix caches)."
    )
    decode_policy: str = opt("least_load", "round_robin, least_load or prefix_aware (also picks colocated nodes).")
    pd_prefill_policy: str = opt(
        "remote",
        "Where prompts run: remote (a prefill node, then the KV moves to the decode), local (the decode "
        "node runs the prompt between its decode steps, within its TPOT guard; decodes that do not are "
        "paired as before), or auto (per request: the prefill node, unless the prompt is a short follow-up "
        "cached on the decode, or the prefill tier is behind its TTFT target and the decode would start it in "
        "under half the time).",
    )
    pd_local_max_tokens: int = opt(
        256, "auto: prompts computing at most this many tokens on the decode (a cached turn) run there."
    )
    pd_remote_ttft_target_ms: float = opt(
        200.0, "auto: above this estimated prefill TTFT, prompts overflow to a decode that starts them sooner."
    )
    pd_mixed_remote_ttft_target_ms: float = opt(
        0.0,
        "auto, for decode nodes that run prompt chunks inside their decode steps (their guard holds every "
        "step): below this estimated prefill TTFT prompts stay on the prefill tier, above it the faster path "
        "wins (0: always the faster path). Each local prompt brings running requests' TPOT up to the guard.",
    )
    pd_pooling: str = opt(
        "off",
        "auto: while the decode tier's load nears its capacity within its TPOT guard and the prefill tier's "
        "is lighter, every node serves whole requests as a colocated replica (prefill nodes started with "
        "--local-decode-tpot-ms, decode nodes with local prompts), and the split returns when the decode "
        "tier has room; always: pooled throughout; off: never. Needs --pd-prefill-policy auto.",
    )
    served_model: Optional[str] = opt(
        None, "Model id clients send (default: the nodes').", aliases=("--served-model-name",)
    )
    tokenizer: Optional[Path] = opt(
        None,
        "Tokenizer directory (tokenizer.json and its side files; default: the model directory the nodes report).",
        aliases=("--tokenizer-path",),
    )
    chat_template: Optional[str] = opt(
        None,
        "Chat template used instead of the tokenizer's: a Jinja file, or the "
        "template itself inline (anything holding {{ or {%).",
    )
    tool_call_parser: Optional[str] = opt(
        None,
        "How the model writes tool calls: hermes (Qwen, Hermes), llama3_json or mistral (default: the format "
        "the chat template shows; without one, requests with tools are refused).",
    )
    api_key: list[str] = opt([], "Accepted API key (repeatable; PDSERVE_API_KEY takes key1,key2).", separator=",")
    max_queue: int = opt(DEFAULT_MAX_QUEUE, "Most requests in flight before 503.")
    prompt_prefix_cache_mb: float = opt(
        DEFAULT_PROMPT_PREFIX_CACHE_MB,
        "Prompt prefixes whose token ids the router keeps, text and ids, in MB (router/prefix_tokens.py): a "
        "chat's next turn then tokenizes only its new messages. 0 turns it off.",
    )
    stream_messages_per_s: float = opt(
        DEFAULT_ROUTER_STREAM_MESSAGES_PER_S,
        "Messages a second the router relays to clients before it asks nodes for more tokens a message "
        "(each new request's stream_interval, as many as keep within it, at most 16; a node's own "
        "--stream-interval can still ask for more). Counted over every node's streams together: a message "
        "costs the router about 0.1 ms of a core (bench/router_paced.py). 0 leaves it to the nodes.",
    )
    prefill_dns: list[str] = opt([], "Headless service NAME:PORT,BOOTSTRAP_PORT whose addresses are prefill nodes.")
    decode_dns: list[str] = opt([], "Headless service NAME:PORT whose addresses are decode nodes.")
    first_token_timeout: float = opt(
        DEFAULT_FIRST_TOKEN_TIMEOUT, "Seconds from sending a request to its first decode message (prefill + transfer)."
    )
    inter_token_timeout: float = opt(DEFAULT_INTER_TOKEN_TIMEOUT, "Seconds between two decode messages.")
    prefill_timeout: float = opt(DEFAULT_PREFILL_TIMEOUT, "Seconds for a whole prefill leg.")
    refresh_interval: float = opt(DEFAULT_REFRESH_INTERVAL, "Seconds between node health/load refreshes.")
    breaker_failures: int = opt(DEFAULT_BREAKER_FAILURES, "Consecutive failures that open a node's circuit breaker.")
    breaker_cooldown: float = opt(
        DEFAULT_BREAKER_COOLDOWN, "Seconds an open breaker waits before letting one request probe the node."
    )
    event_loop: str = opt(
        "auto", "The router's event loop: auto (uvloop where installed, as the router extra does), uvloop or asyncio."
    )

    @property
    def api_keys(self) -> frozenset[str]:
        """The accepted API keys (--api-key, repeatable); empty: no authentication."""
        return frozenset(self.api_key)
