"""What the two dashboards show: each panel's title, kind, unit and PromQL, as plain data.

`dashboards.py` turns these into Grafana JSON with grafana-foundation-sdk. Every query here is
evaluated against a real Prometheus scraping a live embedded cluster (tests/deploy/test_deploy_live.py).
Names come from `dsv4_cluster.metric_names`; `$__rate_interval` is Grafana's own rate window.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_cluster import metric_names as m

RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    kind: str  # "timeseries" | "stat" | "gauge"
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...]


def _q(expr: str, legend: str = "{{worker}}") -> Query:
    return Query(expr, legend)


def _quantiles(metric: str, by: str = "") -> tuple[Query, ...]:
    """p50/p90/p99 of a histogram over the rate window, optionally per label `by`."""
    group = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(_q(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))",
                    f"{prefix}p{int(q * 100)}") for q in (0.5, 0.9, 0.99))


def _ts(title: str, unit: str, *queries: Query, description: str = "") -> PanelSpec:
    return PanelSpec(title, "timeseries", unit, queries, description)


def _stat(title: str, unit: str, *queries: Query, description: str = "") -> PanelSpec:
    return PanelSpec(title, "stat", unit, queries, description)


KV_CACHE_ROWS = (
    RowSpec("KV cache", (
        _ts("KV usage per worker", "percentunit", _q("sglang:token_usage"),
            description="Fraction of each worker's KV pool in use (sglang:token_usage)."),
        _stat("KV capacity per worker", "none", _q("sglang:max_total_num_tokens"),
              description="KV pool capacity in tokens (max_total_num_tokens)."),
        _ts("KV tokens in use", "none", _q("sglang:kv_used_tokens"),
            description="Held by queued or running requests and KV transfers (SGLang: capacity - free - evictable)."),
        _ts("KV tokens free", "none", _q("sglang:kv_available_tokens"), description="Pages no one holds or caches."),
        _ts("KV tokens cached, evictable", "none", _q("sglang:kv_evictable_tokens"),
            description="Prefix-cache pages no request holds: reused on a hit, freed when a request needs room."),
        PanelSpec("KV usage, whole cluster", "gauge", "percentunit",
                  (_q("sum(sglang:kv_used_tokens) / sum(sglang:max_total_num_tokens)", "cluster"),)),
    )),
    RowSpec("Requests", (
        _ts("Running requests", "none", _q("sglang:num_running_reqs")),
        _ts("Queued requests (waiting for KV pages)", "none", _q("sglang:num_queue_reqs")),
        _ts("Router in-flight requests per worker", "none",
            _q(f'{m.ROUTER_IN_FLIGHT}{{job="dsv4-router"}}', "{{worker}} ({{role}})")),
        _stat("Workers the router pairs", "none",
              _q(f'{m.ROUTER_ELIGIBLE}{{job="dsv4-router"}}', "{{worker}}"),
              _q(f'{m.ROUTER_BREAKER_OPEN}{{job="dsv4-router"}}', "{{worker}} breaker open"),
              description="1: the router sends this worker requests; a breaker open takes it out."),
    )),
    RowSpec("Prefill → decode KV transfer", (
        _ts("Prefill bootstrap and in-flight queues", "none",
            _q('sglang:num_prefill_bootstrap_queue_reqs{engine_type="prefill"}', "{{worker}} bootstrap"),
            _q('sglang:num_prefill_inflight_queue_reqs{engine_type="prefill"}', "{{worker}} in flight")),
        _ts("Decode prealloc and transfer queues", "none",
            _q('sglang:num_decode_prealloc_queue_reqs{engine_type="decode"}', "{{worker}} prealloc"),
            _q('sglang:num_decode_transfer_queue_reqs{engine_type="decode"}', "{{worker}} transfer")),
        _ts("KV transfer throughput (last transfer)", "decgbytes", _q("sglang:kv_transfer_speed_gb_s")),
        _ts("KV transfer latency (last transfer)", "ms", _q("sglang:kv_transfer_latency_ms")),
        _ts("KV transfer and bootstrap failures", "short",
            _q(f"increase(sglang:num_transfer_failed_reqs_total[{RATE}])", "{{worker}} transfer"),
            _q(f"increase(sglang:num_bootstrap_failed_reqs_total[{RATE}])", "{{worker}} bootstrap")),
        _ts("Stranded KV (held for rooms no decode will read)", "none", _q(m.STRANDED_KV_TOKENS)),
        _ts("KV page runs per request (one NIXL descriptor each)", "none", *_quantiles(m.KV_ALLOC_RUNS, by="worker"),
            description="In how many runs of consecutive pages the allocator handed a request its new KV pages "
                        "(prefill: its own pages; decode: its reservation); a rising p99 means scattered pools."),
    )),
    RowSpec("Latency and throughput", (
        _ts("Time to first token (router)", "s", *_quantiles(m.ROUTER_TTFT)),
        _ts("Inter-token latency (router)", "s", *_quantiles(m.ROUTER_ITL)),
        _ts("End-to-end latency (router)", "s", *_quantiles(m.ROUTER_E2E)),
        _ts("Time to first token per worker (engine)", "s",
            *_quantiles("sglang:time_to_first_token_seconds", by="worker")),
        _ts("Inter-token latency per worker (engine)", "s",
            *_quantiles("sglang:inter_token_latency_seconds", by="worker")),
        _ts("Generation throughput", "short",
            _q(f"sum by (worker) (rate(sglang:generation_tokens_total[{RATE}]))", "{{worker}} tokens/s"),
            _q("sglang:gen_throughput", "{{worker}} last step")),
        _ts("Prompt tokens", "short",
            _q(f"sum by (worker) (rate(sglang:prompt_tokens_total[{RATE}]))", "{{worker}} tokens/s")),
    )),
    RowSpec("Errors and restarts", (
        _ts("Router errors by route and status", "reqps",
            _q(f'sum by (route, status) (rate({m.ROUTER_REQUESTS}{{status=~"4..|5.."}}[{RATE}]))',
               "{{route}} {{status}}")),
        _ts("Router retries, migrations, aborts and pair failures", "short",
            _q(f"sum(increase({m.ROUTER_RETRIES}[{RATE}]))", "retries"),
            _q(f"sum(increase({m.ROUTER_MIGRATIONS}[{RATE}]))", "migrations"),
            _q(f"sum by (role) (increase({m.ROUTER_ABORTS}[{RATE}]))", "aborts ({{role}})"),
            _q(f"sum(increase({m.ROUTER_PAIR_FAILURES}[{RATE}]))", "pair failures")),
        _ts("Router connection errors per worker", "short",
            _q(f"sum by (worker) (increase({m.ROUTER_CONNECTION_ERRORS}[{RATE}]))")),
        _ts("Aborted requests per worker", "short",
            _q(f"increase(sglang:num_aborted_requests_total[{RATE}])")),
        _stat("Worker restarts", "none",
              _q(f"max by (worker) ({m.CLUSTER_WORKER_RESTARTS})")),
    )),
)

OVERVIEW_ROWS = (
    RowSpec("Processes", (
        _stat("Targets up", "none", _q('up{job=~"dsv4-.*"}', "{{worker}}"),
              description="1: Prometheus scrapes the process; 0: it is down (the DSV4WorkerDown alert)."),
        _stat("Worker states", "none",
              _q(f"{m.CLUSTER_WORKER_STATE} == 1", "{{worker}} {{state}}"),
              description="The supervisor's state of each process (READY, DEGRADED, RESTARTING, FAILED, ...)."),
        _stat("Restarts", "none", _q(f"max by (worker) ({m.CLUSTER_WORKER_RESTARTS})")),
    )),
    RowSpec("Traffic", (
        _ts("Requests by status", "reqps",
            _q(f"sum by (status) (rate({m.ROUTER_REQUESTS}[{RATE}]))", "{{status}}")),
        _ts("Error ratio", "percentunit",
            _q(f'(sum(rate({m.ROUTER_REQUESTS}{{status=~"5.."}}[{RATE}])) or vector(0)) / '
               f"sum(rate({m.ROUTER_REQUESTS}[{RATE}]))", "5xx / all"),
            description="0 while requests flow and none fails; no data while there is no traffic."),
        _ts("Output tokens per second, cluster", "short",
            _q(f'sum(rate(sglang:generation_tokens_total{{engine_type="decode"}}[{RATE}]))', "decode")),
        _ts("TTFT p99 (router)", "s",
            _q(f"histogram_quantile(0.99, sum by (le) (rate({m.ROUTER_TTFT}_bucket[{RATE}])))", "p99")),
        _ts("End-to-end p99 (router)", "s",
            _q(f"histogram_quantile(0.99, sum by (le) (rate({m.ROUTER_E2E}_bucket[{RATE}])))", "p99")),
    )),
    RowSpec("Capacity", (
        _ts("KV usage per worker", "percentunit", _q("sglang:token_usage")),
        _ts("Running and queued requests", "none",
            _q("sum by (engine_type) (sglang:num_running_reqs)", "{{engine_type}} running"),
            _q("sum by (engine_type) (sglang:num_queue_reqs)", "{{engine_type}} queued")),
    )),
)
