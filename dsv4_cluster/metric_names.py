"""Metric names are an API: the dashboards, the alert rules and the tests read them from here.

Workers (either engine) export SGLang's names (`sglang:*`, labels `model_name`, `engine_type`);
the router exports `dsv4_router_*`; the orchestrator's exporter exports `dsv4_cluster_*`.
Prometheus adds `job`, `instance`, and from the targets files `worker`, `role`, `node` (the router's and
the exporter's own `worker`/`role` labels win over their target's: `honor_labels`).
"""

from __future__ import annotations

# Workers: SGLang 0.5.23's names (`--enable-metrics`), also exported by the embedded engine.
WORKER_GAUGES = (
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
    "sglang:num_used_tokens", "sglang:kv_used_tokens", "sglang:kv_available_tokens", "sglang:kv_evictable_tokens",
    "sglang:max_total_num_tokens", "sglang:gen_throughput", "sglang:cache_hit_rate",
    "sglang:context_len", "sglang:page_size",
    "sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
    "sglang:kv_transfer_speed_gb_s", "sglang:kv_transfer_latency_ms",
)
WORKER_COUNTERS = (
    "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:num_requests_total",
    "sglang:num_aborted_requests_total", "sglang:num_bootstrap_failed_reqs_total",
    "sglang:num_transfer_failed_reqs_total", "sglang:cached_tokens_total",
)
WORKER_HISTOGRAMS = (
    "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
    "sglang:e2e_request_latency_seconds",
)
# Stranded KV: what an embedded prefill holds for rooms no decode reserved (workers/prefill/stranded.py),
# labels model_name, engine_type (prefill only; SGLang's prefill does not export them).
STRANDED_KV_TOKENS = "dsv4_stranded_kv_tokens"  # gauge: KV tokens held now
STRANDED_KV_ROOMS = "dsv4_stranded_kv_rooms"  # gauge: bootstrap rooms held now
STRANDED_KV_FREED_TOKENS = "dsv4_stranded_kv_freed_tokens_total"  # counter: freed at the deadline
STRANDED_KV_FREED_ROOMS = "dsv4_stranded_kv_freed_rooms_total"  # counter
# KV writes an embedded prefill cancelled past `transfer.write_timeout_s` (workers/prefill/engine.py), counter,
# labels model_name, engine_type (prefill only).
KV_WRITE_TIMEOUTS = "dsv4_kv_write_timeouts_total"
# Histogram: in how many runs of consecutive pages the allocator handed a request its new KV pages (prefill: the
# pages it computes, its cached prefix aside; decode: its reservation); one NIXL descriptor per run on both sides.
# Labels model_name, engine_type (both roles of the embedded engine).
KV_ALLOC_RUNS = "dsv4_kv_alloc_page_runs"
STRANDED_KV = (STRANDED_KV_TOKENS, STRANDED_KV_ROOMS, STRANDED_KV_FREED_TOKENS, STRANDED_KV_FREED_ROOMS)

# Router (names as the router issue's code spells them).
ROUTER_REQUESTS = "dsv4_router_requests_total"  # labels route, status
ROUTER_TTFT = "dsv4_router_time_to_first_token_seconds"
ROUTER_ITL = "dsv4_router_inter_token_latency_seconds"
ROUTER_E2E = "dsv4_router_e2e_request_latency_seconds"  # label route
ROUTER_IN_FLIGHT = "dsv4_router_worker_in_flight"  # labels worker, role
ROUTER_ELIGIBLE = "dsv4_router_worker_eligible"  # labels worker, role; 1 while the router pairs it
ROUTER_BREAKER_OPEN = "dsv4_router_worker_breaker_open"  # labels worker, role
ROUTER_RETRIES = "dsv4_router_retries_total"
ROUTER_MIGRATIONS = "dsv4_router_migrations_total"
ROUTER_STREAM_HOLDS = "dsv4_router_stream_hold_tries_total"  # fresh pairs tried while a stream waited for a decode
ROUTER_ABORTS = "dsv4_router_aborts_total"  # label role
ROUTER_PAIR_FAILURES = "dsv4_router_pair_failures_total"
ROUTER_CONNECTION_ERRORS = "dsv4_router_upstream_connection_errors_total"  # label worker

# Orchestrator (the exporter `dsv4-cluster monitor up` runs beside Prometheus).
CLUSTER_WORKER_STATE = "dsv4_cluster_worker_state"  # labels worker, role, node, state; 1 = current
CLUSTER_WORKER_RESTARTS = "dsv4_cluster_worker_restarts_total"  # labels worker, role, node
CLUSTER_CONTROLLER_UP = "dsv4_cluster_controller_up"  # 0: no cluster recorded, or its controller is silent
