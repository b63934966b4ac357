"""The pdserve dashboard's rows and panels: titles, units, descriptions and PromQL (the data
deploy/grafana/dashboard.py renders). Metric names are those of engine/service/metrics.py and
router/metrics.py. The serving rows are here, the routing rows in panels_routing.py."""

from __future__ import annotations

from deploy.grafana.panel_kit import W, Panel, quantile
from deploy.grafana.panels_routing import ROUTING_ROWS

CORE_ROWS: list[tuple[str, list[Panel]]] = [
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
                    (quantile(0.5, "pdserve_router_ttft_stage_seconds", "le, stage"), "{{stage}}"),
                    (quantile(0.5, "pdserve_kv_transfer_seconds", match='{role="prefill"}'), "transfer (KV write)"),
                    (quantile(0.5, "pdserve_node_queue_time_seconds", match='{role="prefill"}'), "prefill node queue"),
                ],
            ),
            Panel(
                "Time to first token",
                "s",
                "Arrival at the router to the first generated token.",
                [
                    (quantile(p, "pdserve_router_time_to_first_token_seconds"), f"p{int(p * 100)}")
                    for p in (0.5, 0.9, 0.99)
                ],
            ),
            Panel(
                "Event-loop lag (p99)",
                "s",
                "How late a 20-ms timer fires on the routers' event loops and on each node role's: every "
                "stream that loop relays stands still for as long. A router whose lag climbs under load "
                "is out of CPU (its process_cpu_seconds_total near one core), whatever the nodes do.",
                [
                    (quantile(0.99, "pdserve_router_event_loop_lag_seconds"), "router"),
                    (quantile(0.99, "pdserve_node_event_loop_lag_seconds", "le, role"), "{{role}} node"),
                ],
            ),
            Panel(
                "Streamed tokens per message",
                "none",
                "Tokens each node's streamed messages gather after a stream's first (--stream-interval; "
                "under auto, a token a message until a node streams more tokens a second than its "
                "--stream-messages-per-s), and what the router asks of new requests (more than 1 while it "
                "relays more tokens a second than its own --stream-messages-per-s). Above 1 the router's "
                "event loop is being spared.",
                [
                    ("max by (role) (pdserve_node_stream_interval_tokens)", "{{role}} tokens a message"),
                    ("max(pdserve_router_stream_interval_tokens)", "router asks"),
                ],
            ),
            Panel(
                "End-to-end latency",
                "s",
                "Arrival to the last token of completed requests, PD and colocated.",
                [
                    (
                        quantile(p, "pdserve_router_e2e_request_latency_seconds", "le, disaggregated"),
                        f"p{int(p * 100)} disaggregated={{{{disaggregated}}}}",
                    )
                    for p in (0.5, 0.99)
                ],
            ),
            Panel(
                "Inter-token latency",
                "s",
                "Gap between consecutive output tokens of a choice.",
                [
                    (quantile(p, "pdserve_router_inter_token_latency_seconds"), f"p{int(p * 100)}")
                    for p in (0.5, 0.9, 0.99)
                ],
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
                [(quantile(0.9, "pdserve_node_queue_time_seconds", "le, role"), "{{role}}")],
            ),
            Panel(
                "Batch launch time (p90)",
                "s",
                "Host time to launch one batch on the device, prompt chunks, mixed steps (a chunk inside a "
                "decode step) and decode steps apart. A prompt chunk whose launch takes about as long as the chunk "
                "itself is launch-bound: host load (other threads, other processes) then slows prompts.",
                [(quantile(0.9, "pdserve_node_launch_seconds", "le, role, kind"), "{{kind}} {{role}}")],
            ),
            Panel(
                "Batch step time (mean)",
                "s",
                "The time each batch is charged, from its launch (or the previous batch's end) to its results "
                "on the host: what the node's rates and TPOT guard measure. A mixed step far above a decode "
                "step of the same node costs its running requests more than its chunk's tokens explain.",
                [
                    (
                        f"sum by (role, kind) (rate(pdserve_node_step_seconds_sum[{W}])) / "
                        f"sum by (role, kind) (rate(pdserve_node_step_seconds_count[{W}]))",
                        "{{kind}} {{role}}",
                    )
                ],
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
                    (quantile(p, "pdserve_kv_transfer_seconds", "le, role"), f"p{int(p * 100)} {{{{role}}}}")
                    for p in (0.5, 0.99)
                ],
            ),
            Panel(
                "KV handoff tail and destination page runs",
                "short",
                "Prefill: last prompt chunk computed to final KV write done, in ms (what the handoff adds to "
                "a remote prompt's TTFT), and the runs of pages consecutive on both sides its final writes "
                "carry. Decode: runs of consecutive pages a prompt's KV lands in (each run is a copy per "
                "layer and K|V: a fragmented pool turns a handoff into many small copies).",
                [
                    (f"1000 * {quantile(p, 'pdserve_kv_handoff_tail_seconds')}", f"tail ms p{int(p * 100)}")
                    for p in (0.5, 0.99)
                ]
                + [(quantile(p, "pdserve_kv_destination_runs"), f"page runs p{int(p * 100)}") for p in (0.5, 0.9)]
                + [(quantile(0.9, "pdserve_kv_write_runs", match='{kind="final"}'), "final write runs p90")],
            ),
            Panel(
                "KV transfer failures by reason",
                "reqps",
                "PD requests that failed before decoding.",
                [(f"sum by (role, reason) (rate(pdserve_kv_transfer_failures_total[{W}]))", "{{role}} {{reason}}")],
            ),
        ],
    ),
]

ROWS = CORE_ROWS + ROUTING_ROWS

__all__ = ["ROWS", "Panel"]
