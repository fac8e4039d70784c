"""Prometheus metrics under SGLang's names, so one dashboard and one alert set serve both engines.

Gauges and counters are read from the engine's live statistics at scrape time (a custom collector,
no second copy of the numbers); latency histograms are observed by the HTTP handlers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ...core import Role
from ...metric_names import KV_ALLOC_RUNS
from ..engine.loop import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _EngineCollector:
    def __init__(self, engine: Engine, role: Role, labels: dict[str, str], context_length: int):
        self.engine, self.role, self.labels, self.context_length = engine, role, labels, context_length

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        s, pool = self.engine.stats, self.engine.runner.pool
        cap, used = pool.capacity_tokens, pool.used_tokens
        g, c = self._gauge, self._counter
        yield g("sglang:num_running_reqs", "Requests in the running batch", s.num_running)
        # SGLang's meaning on a PD worker: the waiting queue beside the PD queues below (a decode's requests whose KV
        # arrived, a prefill's bootstrapped ones); here every such request runs at once, so the backlog is all in
        # the PD queues (counting it here as well would count it twice)
        pd = self.role in (Role.PREFILL, Role.DECODE)
        yield g("sglang:num_queue_reqs", "Requests waiting to run (besides the PD queues)", 0 if pd else s.num_queued)
        # SGLang's accounting: capacity = available (free pages) + evictable (cached, no request holds them) + used
        yield g("sglang:token_usage", "Fraction of the KV pool in use (cached pages no request holds are not)",
                used / cap if cap else 0.0)
        yield g("sglang:num_used_tokens", "KV tokens in use: capacity - (available + evictable)", used)
        yield g("sglang:kv_used_tokens", "KV tokens in use: capacity - (available + evictable)", used)
        yield g("sglang:kv_available_tokens", "KV tokens of free pages", pool.available_tokens)
        yield g("sglang:kv_evictable_tokens", "KV tokens the prefix cache keeps that no request holds (freed on "
                "demand)", pool.evictable_tokens)
        yield g("sglang:max_total_num_tokens", "KV pool capacity in tokens", cap)
        yield g("sglang:gen_throughput", "Tokens generated per second over the last 5 s", s.last_gen_throughput)
        cache = getattr(self.engine, "cache", None)          # the prefill's prefix cache (decode keeps none)
        yield g("sglang:cache_hit_rate", "Prefix cache hit rate: cached / prompt tokens over the last 256 prompts",
                cache.hit_rate if cache is not None else 0.0)
        cached = CounterMetricFamily("sglang:cached_tokens", "Prompt tokens whose KV came from the prefix cache",
                                     labels=[*self.labels, "cache_source"])
        cached.add_metric([*self.labels.values(), "device"], cache.cached_tokens_total if cache is not None else 0)
        yield cached
        yield g("sglang:context_len", "Maximum context length", self.context_length)
        yield g("sglang:page_size", "KV page size in tokens", pool.layout.page_size)
        yield g("sglang:num_prefill_bootstrap_queue_reqs", "Prefill requests waiting for pages",
                s.num_queued if self.role is Role.PREFILL else 0)
        yield g("sglang:num_prefill_inflight_queue_reqs", "Prefill requests waiting for or in KV transfer",
                s.num_waiting_peer + s.num_transferring if self.role is Role.PREFILL else 0)
        yield g("sglang:num_decode_prealloc_queue_reqs", "Decode requests waiting for pages",
                s.num_queued if self.role is Role.DECODE else 0)
        yield g("sglang:num_decode_transfer_queue_reqs", "Decode requests waiting for KV to arrive",
                s.num_waiting_peer if self.role is Role.DECODE else 0)
        yield g("sglang:kv_transfer_speed_gb_s", "Mean speed of the KV transfers of the last 5 s",
                s.transfer_gb_s.mean())
        yield g("sglang:kv_transfer_latency_ms", "Mean latency of the KV transfers of the last 5 s",
                s.transfer_ms.mean())
        yield c("sglang:prompt_tokens", "Prompt tokens processed", s.prompt_tokens)
        yield c("sglang:generation_tokens", "Tokens generated", s.generation_tokens)
        yield c("sglang:num_requests", "Requests received", s.requests)
        yield c("sglang:num_aborted_requests", "Requests aborted", s.aborted)
        yield c("sglang:num_bootstrap_failed_reqs", "Requests whose bootstrap failed", s.bootstrap_failed)
        yield c("sglang:num_transfer_failed_reqs", "Requests whose KV transfer failed", s.transfer_failed)
        runs = HistogramMetricFamily(KV_ALLOC_RUNS, "Runs of consecutive pages a request's new KV pages came in "
                                     "(one NIXL descriptor each)", labels=list(self.labels))
        runs.add_metric(list(self.labels.values()), s.alloc_runs.cumulative(), s.alloc_runs.total)
        yield runs
        for kind, name, doc, value in self.engine.role_metrics():
            yield (g if kind == "gauge" else c)(name, doc, value)


class WorkerMetrics:
    def __init__(self, engine: Engine, model_name: str, role: Role, context_length: int):
        labels = {"model_name": model_name, "engine_type": role.value}   # the wire form ("prefill") SGLang labels with
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, role, labels, context_length))

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(**labels)

        self.ttft = hist("sglang:time_to_first_token_seconds", "Time to first token")
        self.itl = hist("sglang:inter_token_latency_seconds", "Time between two output tokens")
        self.e2e = hist("sglang:e2e_request_latency_seconds", "Request latency, arrival to last token")

    def render(self) -> bytes:
        return generate_latest(self.registry)
