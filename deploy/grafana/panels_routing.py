"""The dashboard's routing rows: the prefill path and tier balance, the prefix cache, the router's
health (deploy/grafana/panels.py puts them after the serving rows)."""

from __future__ import annotations

from deploy.grafana.panel_kit import W, Panel, quantile

ROUTING_ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Prefill path and tier balance",
        [
            Panel(
                "Requests by prefill path",
                "reqps",
                "Where prompts ran: remote (a prefill node), local (the decode node, between its decode steps, "
                "or inside them, the default: mixed steps/s), whole (the whole request on a prefill node, "
                "the decode at its TPOT budget), colocated; and why the router chose (--pd-prefill-policy).",
                [
                    (f"sum by (path) (rate(pdserve_router_prefill_path_total[{W}]))", "{{path}}"),
                    (
                        f"sum by (reason) (rate(pdserve_router_prefill_path_decisions_total[{W}]))",
                        "reason {{reason}}",
                    ),
                    (f"sum by (role) (rate(pdserve_node_mixed_steps_total[{W}]))", "mixed steps {{role}}"),
                ],
            ),
            Panel(
                "Prompt chunks inside decode steps, and eager forwards",
                "short",
                "What a node that runs prompts beside its decode steps prices them by: its measured prompt "
                "tokens/s inside a decode step (warm-up measures it first; a reading far below the prompt "
                "rate keeps its chunks small). And where CUDA graphs are on, target forwards/s replayed "
                "from a graph or run eagerly, by reason (an eager forward costs the host's launches again), "
                "and Triton kernels compiled while serving: a shape start-up did not warm, whose step waited "
                "for the compile (any rate above zero after start-up is a stall; "
                "pdserve_node_kernel_compile_seconds_total names the kernels).",
                [
                    ("max by (role) (pdserve_node_mixed_prefill_tokens_per_second)", "mixed tok/s {{role}}"),
                    (
                        f"sum by (path, reason) (rate(pdserve_node_graph_forwards_total[{W}]))",
                        "forwards/s {{path}} {{reason}}",
                    ),
                    (
                        f"sum by (instance) (rate(pdserve_node_kernel_compiles_total[{W}]))",
                        "compiles/s {{instance}}",
                    ),
                ],
            ),
            Panel(
                "Estimated TTFT by prefill path",
                "s",
                "The router's TTFT estimate for each path when it chose one, from the nodes' measured rates "
                "and queues; compare with the measured TTFT.",
                [
                    (
                        quantile(p, "pdserve_router_prefill_path_estimate_seconds", "le, path"),
                        f"p{int(p * 100)} {{{{path}}}}",
                    )
                    for p in (0.5, 0.9)
                ],
            ),
            Panel(
                "TTFT observed over estimated, by node",
                "short",
                "How each node's prompts compared with the router's estimates (1: as estimated); the path "
                "decision scales later estimates by it, so a path slower than its rates say is used less.",
                [("max by (node, role) (pdserve_router_ttft_estimate_ratio)", "{{role}} {{node}}")],
            ),
            Panel(
                "Prefill tier: demand vs capacity",
                "short",
                "Prompt tokens/s the routers dispatched (60 s window, remote and local) against the healthy "
                "prefill nodes' measured prompt rates.",
                [
                    ("sum(pdserve_router_prefill_demand_tokens_per_second)", "demand tok/s"),
                    ("max(pdserve_router_prefill_capacity_tokens_per_second)", "capacity tok/s"),
                ],
            ),
            Panel(
                "Decode tier: demand vs capacity",
                "short",
                "Output tokens/s the routers streamed (60 s window) against the healthy decode nodes' estimated "
                "decode capacity.",
                [
                    ("sum(pdserve_router_decode_demand_tokens_per_second)", "demand tok/s"),
                    ("max(pdserve_router_decode_capacity_tokens_per_second)", "capacity tok/s"),
                ],
            ),
            Panel(
                "Pooled (colocated fallback) and tier load",
                "short",
                "With --pd-pooling: 1 while every node serves whole requests as a colocated replica (the "
                "decode tier was what the load exhausted), 0 while split; and the recent (5 s) load the router "
                "decides on: prefill (prompt tokens to compute over the prefill nodes' rates), decode (the "
                "decode step at the recent output rate over its TPOT guard; decode_batch at the batch it runs "
                "now), pooled (every node's step at its share of prompts and output).",
                [
                    ("max(pdserve_router_pd_pooled)", "pooled"),
                    ("max by (tier) (pdserve_router_tier_load >= 0)", "load {{tier}}"),
                    (f"sum by (to) (increase(pdserve_router_pd_pool_switches_total[{W}]))", "switches to {{to}}"),
                ],
            ),
            Panel(
                "Prefill:decode node ratio",
                "short",
                "Prefill nodes per decode node that would balance the current load, (prefill demand / "
                "capacity per prefill node) / (decode demand / capacity per decode node), against the "
                "ratio deployed; and the nodes of each tier that would carry it, decode nodes counted so "
                "that each one's steps stay within its TPOT guard (from its measured step line). Routers "
                "answer NaN (left out here) while a rate is unmeasured or nothing decodes.",
                [
                    ("avg(pdserve_router_balanced_prefill_decode_ratio >= 0)", "balanced"),
                    # the same from the decode step line: decode nodes whose steps stay within the guard
                    ('max(pdserve_router_nodes_needed{tier="prefill"} >= 0)', "prefill nodes needed"),
                    ('max(pdserve_router_nodes_needed{tier="decode"} >= 0)', "decode nodes needed (within TPOT)"),
                    (
                        'count(pdserve_node_waiting_prompt_tokens{role="prefill"}) '
                        '/ count(pdserve_node_waiting_prompt_tokens{role="decode"})',
                        "deployed",
                    ),
                ],
            ),
        ],
    ),
    (
        "Prefix cache",
        [
            Panel(
                "Prompt tokens found in the prefix cache",
                "percentunit",
                "Share of admitted prompt tokens each role found cached (not computed). In PD the prefill's "
                "share is what its prompts skipped; the decode's, what local prompts skipped.",
                [
                    (
                        f"sum by (role) (rate(pdserve_node_cached_prompt_tokens_total[{W}])) "
                        f"/ sum by (role) (rate(pdserve_node_admitted_prompt_tokens_total[{W}]))",
                        "{{role}}",
                    )
                ],
            ),
            Panel(
                "Cached tokens per request",
                "short",
                "Prompt tokens each request found in the prefix cache, p50 and p90 per role.",
                [
                    (quantile(0.5, "pdserve_node_cached_prompt_tokens_per_request", "le, role"), "p50 {{role}}"),
                    (quantile(0.9, "pdserve_node_cached_prompt_tokens_per_request", "le, role"), "p90 {{role}}"),
                ],
            ),
            Panel(
                "Cached pages",
                "short",
                "KV pages the prefix cache holds per node, and those no running request reads (they go "
                "to new requests, least recently used first, when the pool runs short).",
                [
                    ("sum by (role, instance) (pdserve_prefix_cache_pages)", "cached {{role}} {{instance}}"),
                    (
                        "sum by (role, instance) (pdserve_prefix_cache_evictable_pages)",
                        "evictable {{role}} {{instance}}",
                    ),
                ],
            ),
            Panel(
                "Router: expected cache hit and indexed pages",
                "short",
                "Prompt tokens each routed request was expected to find cached on the node that ran it "
                "(p50, p90), and the pages each node's published cache holds as the router follows it.",
                [
                    (quantile(0.5, "pdserve_router_expected_cache_hit_tokens"), "expected hit p50"),
                    (quantile(0.9, "pdserve_router_expected_cache_hit_tokens"), "expected hit p90"),
                    ("max by (node, role) (pdserve_router_indexed_kv_blocks)", "indexed {{role}} {{node}}"),
                ],
            ),
            Panel(
                "Pages cached, evicted and not transferred",
                "short",
                "Pages per second the cache took and gave back, and prompt pages decode nodes held already "
                "so the prefill did not write them.",
                [
                    (f"sum by (role) (rate(pdserve_prefix_cache_inserted_pages_total[{W}]))", "cached {{role}}"),
                    (f"sum by (role) (rate(pdserve_prefix_cache_evicted_pages_total[{W}]))", "evicted {{role}}"),
                    (f"sum(rate(pdserve_kv_transfer_skipped_pages_total[{W}]))", "not transferred (decode held them)"),
                ],
            ),
        ],
    ),
    (
        "Router health",
        [
            Panel(
                "Retries by reason",
                "reqps",
                "Attempts retried on a new pair before the first token.",
                [(f"sum by (reason) (rate(pdserve_router_retries_total[{W}]))", "{{reason}}")],
            ),
            Panel(
                "Circuit breakers and node health",
                "short",
                "Breaker per node (0 closed, 1 open, 2 "
                "half-open, as SMG) and whether the node's last health refresh succeeded.",
                [
                    ("max by (node, role) (pdserve_router_breaker_state)", "breaker {{role}} {{node}}"),
                    ("min by (node, role) (pdserve_router_node_up)", "up {{role}} {{node}}"),
                ],
                {0: "closed", 1: "open", 2: "half-open"},
            ),
            Panel(
                "Routers ready",
                "short",
                "Routers whose /ready passes (a compatible pair completed a handoff lately).",
                [("sum(pdserve_router_ready)", "ready routers")],
            ),
        ],
    ),
]
