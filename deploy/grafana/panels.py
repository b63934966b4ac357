"""The pdserve dashboard's rows and panels: titles, units, descriptions and PromQL (the data
deploy/grafana/dashboard.py renders). Metric names are those of engine/service/metrics.py and
router/metrics.py."""

from __future__ import annotations

from dataclasses import dataclass, field

W = "$__rate_interval"  # Grafana's rate window: at least four scrape intervals


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    mappings: dict[int, str] = field(default_factory=dict)  # value -> text (breaker states)


def _q(p: float, metric: str, by: str = "le", match: str = "") -> str:
    return f"histogram_quantile({p}, sum by ({by}) (rate({metric}_bucket{match}[{W}])))"


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Requests",
        [
            Panel(
                "Request rate by endpoint and status",
                "reqps",
                'API responses of the routers (probes and scrapes, endpoint="other", left out).',
                [
                    (
                        f'sum by (endpoint, status) (rate(pdserve_router_requests_total{{endpoint!="other"}}[{W}]))',
                        "{{endpoint}} {{status}}",
                    )
                ],
            ),
            Panel(
                "Errors by status",
                "reqps",
                "Non-2xx responses, streams that failed after the first byte, requests shed at the queue limit.",
                [
                    (
                        f'sum by (status) (rate(pdserve_router_requests_total{{endpoint!="other",status!~"2.."}}[{W}]))',
                        "HTTP {{status}}",
                    ),
                    (f"sum(rate(pdserve_router_stream_errors_total[{W}])) or vector(0)", "stream errors"),
                    (f"sum(rate(pdserve_router_requests_shed_total[{W}]))", "shed (queue full)"),
                ],
            ),
        ],
    ),
    (
        "Latency",
        [
            Panel(
                "TTFT by stage (p50)",
                "s",
                "Router stages: queue (pair selection, retries), prefill (node "
                "queue + prompt + KV write, until the prefill answers), first decode (decode commit + first step; ~0 when "
                "the router relayed the prefill's own first token). "
                "The KV write alone and the prefill node's queue time come from the nodes.",
                [
                    (_q(0.5, "pdserve_router_ttft_stage_seconds", "le, stage"), "{{stage}}"),
                    (_q(0.5, "pdserve_kv_transfer_seconds", match='{role="prefill"}'), "transfer (KV write)"),
                    (_q(0.5, "pdserve_node_queue_time_seconds", match='{role="prefill"}'), "prefill node queue"),
                ],
            ),
            Panel(
                "Time to first token",
                "s",
                "Arrival at the router to the first generated token.",
                [(_q(p, "pdserve_router_time_to_first_token_seconds"), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)],
            ),
            Panel(
                "End-to-end latency",
                "s",
                "Arrival to the last token of completed requests, PD and colocated.",
                [
                    (
                        _q(p, "pdserve_router_e2e_request_latency_seconds", "le, disaggregated"),
                        f"p{int(p * 100)} disaggregated={{{{disaggregated}}}}",
                    )
                    for p in (0.5, 0.99)
                ],
            ),
            Panel(
                "Inter-token latency",
                "s",
                "Gap between consecutive output tokens of a choice.",
                [(_q(p, "pdserve_router_inter_token_latency_seconds"), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)],
            ),
        ],
    ),
    (
        "Throughput",
        [
            Panel(
                "Token throughput",
                "short",
                "Tokens per second of completed requests.",
                [
                    (f"sum(rate(pdserve_router_completion_tokens_total[{W}]))", "output tok/s"),
                    (f"sum(rate(pdserve_router_prompt_tokens_total[{W}]))", "prompt tok/s"),
                ],
            ),
            Panel(
                "In-flight requests",
                "short",
                "Requests the routers serve now, and each node's running batch.",
                [
                    ("sum(pdserve_router_requests_in_flight)", "routers"),
                    ("sum by (instance, role) (pdserve_node_running_requests)", "running {{role}} {{instance}}"),
                ],
            ),
        ],
    ),
    (
        "Nodes",
        [
            Panel(
                "KV cache usage per node",
                "percentunit",
                "KV cache tokens in use / capacity.",
                [("max by (instance, role) (pdserve_kv_cache_usage_ratio)", "{{role}} {{instance}}")],
            ),
            Panel(
                "Node queue depths",
                "short",
                "waiting: queued for admission; prealloc: decode waiting for KV "
                "pages / prefill waiting for a destination; transfer: decode waiting for the KV write / "
                "prefill computing or writing.",
                [
                    ("sum by (instance, role) (pdserve_node_waiting_requests)", "waiting {{role}} {{instance}}"),
                    ("sum by (instance, role, queue) (pdserve_pd_queue_requests)", "{{queue}} {{role}} {{instance}}"),
                ],
            ),
            Panel(
                "Node queue time (p90)",
                "s",
                "Waiting queue to admission into a batch, per role.",
                [(_q(0.9, "pdserve_node_queue_time_seconds", "le, role"), "{{role}}")],
            ),
            Panel(
                "Batch launch time (p90)",
                "s",
                "Host time to launch one batch on the device, prompt chunks and "
                "decode steps apart. A prompt chunk whose launch takes about as long as the chunk itself is "
                "launch-bound: host load (other threads, other processes) then slows prompts.",
                [(_q(0.9, "pdserve_node_launch_seconds", "le, role, kind"), "{{kind}} {{role}}")],
            ),
            Panel(
                "Finished requests and retractions",
                "reqps",
                "Requests ending per finish reason (abort: "
                "cancelled or failed) and running requests sent back to the queue.",
                [
                    (f"sum by (role, reason) (rate(pdserve_node_finished_requests_total[{W}]))", "{{role}} {{reason}}"),
                    (f"sum by (role) (rate(pdserve_node_retractions_total[{W}]))", "retractions {{role}}"),
                ],
            ),
        ],
    ),
    (
        "Speculative decoding",
        [
            Panel(
                "Accept length per node",
                "short",
                "Tokens per target forward: 1 + accepted drafts / verifies.",
                [
                    (
                        f'1 + sum by (instance, role) (rate(pdserve_spec_accepted_tokens_total{{role=~"decode|colocated"}}[{W}])) '
                        f'/ sum by (instance, role) (rate(pdserve_spec_verifies_total{{role=~"decode|colocated"}}[{W}]))',
                        "{{role}} {{instance}}",
                    )
                ],
            ),
            Panel(
                "Acceptance rate: PD vs colocated",
                "percentunit",
                "Accepted drafts / drafts proposed; decode nodes are the PD path, colocated nodes the baseline.",
                [
                    (
                        f'sum by (role) (rate(pdserve_spec_accepted_tokens_total{{role=~"decode|colocated"}}[{W}])) '
                        f'/ sum by (role) (rate(pdserve_spec_draft_tokens_total{{role=~"decode|colocated"}}[{W}]))',
                        "{{role}}",
                    )
                ],
            ),
            Panel(
                "Adaptive speculative steps",
                "short",
                "Draft steps the adaptive policy chose, averaged over "
                "its batch-size slots (only with --speculative-adaptive).",
                [("avg by (instance, role) (pdserve_spec_adaptive_steps)", "{{role}} {{instance}}")],
            ),
            Panel(
                "Model load time",
                "s",
                "Engine construction at start-up (weights, draft, KV pool, CUDA graphs).",
                [("max by (instance, role) (pdserve_model_load_seconds)", "{{role}} {{instance}}")],
            ),
        ],
    ),
    (
        "KV transfer",
        [
            Panel(
                "KV transfer bandwidth",
                "Bps",
                "KV page and aux row bytes written by prefill nodes / received by decode nodes.",
                [(f"sum by (instance, role) (rate(pdserve_kv_transfer_bytes_total[{W}]))", "{{role}} {{instance}}")],
            ),
            Panel(
                "KV transfer latency",
                "s",
                "Prefill: write posted to completed. Decode: destination sent to KV landed.",
                [
                    (_q(p, "pdserve_kv_transfer_seconds", "le, role"), f"p{int(p * 100)} {{{{role}}}}")
                    for p in (0.5, 0.99)
                ],
            ),
            Panel(
                "KV handoff tail and destination page runs",
                "short",
                "Prefill: last prompt chunk computed to final KV write done, in ms (what the handoff adds to "
                "a remote prompt's TTFT). Decode: runs of consecutive pages a prompt's KV lands in (each run "
                "is a copy per layer and K|V: a fragmented pool turns a handoff into many small copies).",
                [
                    (f"1000 * {_q(p, 'pdserve_kv_handoff_tail_seconds')}", f"tail ms p{int(p * 100)}")
                    for p in (0.5, 0.99)
                ]
                + [(_q(p, "pdserve_kv_destination_runs"), f"page runs p{int(p * 100)}") for p in (0.5, 0.9)],
            ),
            Panel(
                "KV transfer failures by reason",
                "reqps",
                "PD requests that failed before decoding.",
                [(f"sum by (role, reason) (rate(pdserve_kv_transfer_failures_total[{W}]))", "{{role}} {{reason}}")],
            ),
        ],
    ),
    (
        "Prefill path and tier balance",
        [
            Panel(
                "Requests by prefill path",
                "reqps",
                "Where prompts ran: remote (a prefill node), local (the decode node, between its decode steps, "
                "or inside them with --enable-mixed-chunk: mixed steps/s), colocated; and why the router chose "
                "(--pd-prefill-policy).",
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
                "Estimated TTFT by prefill path",
                "s",
                "The router's TTFT estimate for each path when it chose one, from the nodes' measured rates "
                "and queues; compare with the measured TTFT.",
                [
                    (_q(p, "pdserve_router_prefill_path_estimate_seconds", "le, path"), f"p{int(p * 100)} {{{{path}}}}")
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
                "Prefill:decode node ratio",
                "short",
                "Prefill nodes per decode node that would balance the current load, (prefill demand / "
                "capacity per prefill node) / (decode demand / capacity per decode node), against the "
                "ratio deployed. Routers answer NaN (left out here) while a rate is unmeasured or nothing decodes.",
                [
                    ("avg(pdserve_router_balanced_prefill_decode_ratio >= 0)", "balanced"),
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
                    (_q(0.5, "pdserve_node_cached_prompt_tokens_per_request", "le, role"), "p50 {{role}}"),
                    (_q(0.9, "pdserve_node_cached_prompt_tokens_per_request", "le, role"), "p90 {{role}}"),
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
                    (_q(0.5, "pdserve_router_expected_cache_hit_tokens"), "expected hit p50"),
                    (_q(0.9, "pdserve_router_expected_cache_hit_tokens"), "expected hit p90"),
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
