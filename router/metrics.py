"""The router's Prometheus metrics (`GET /metrics`), all named `dsv4_router_*` (metric names are an API).

Each app has its own registry, so several routers in one process (tests) do not collide. Per-worker
gauges (in flight, eligible, breaker) are read from the pool when scraped, never kept twice.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dsv4_cluster import metric_names as m

from .pool import WorkerPool

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker", "role"]
        in_flight = GaugeMetricFamily(m.ROUTER_IN_FLIGHT, "Requests in flight per worker", labels=labels)
        eligible = GaugeMetricFamily(m.ROUTER_ELIGIBLE, "1 while the router pairs the worker",
                                     labels=labels)
        breaker = GaugeMetricFamily(m.ROUTER_BREAKER_OPEN, "1 while the worker's circuit breaker is open",
                                    labels=labels)
        for w in self._pool.workers:
            in_flight.add_metric([w.name, w.role.value], w.in_flight)
            eligible.add_metric([w.name, w.role.value], float(w.eligible))
            breaker.add_metric([w.name, w.role.value], float(w.breaker_open))
        yield from (in_flight, eligible, breaker)


class RouterMetrics:
    """Counters and histograms the request path updates."""

    def __init__(self, pool: WorkerPool) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(m.ROUTER_REQUESTS, "Client requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram(m.ROUTER_TTFT, "Request arrival to the first streamed event",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(m.ROUTER_ITL, "Time between streamed events of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(m.ROUTER_E2E, "Request arrival to its last byte",
                             ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter(m.ROUTER_RETRIES, "Requests retried on a fresh pair before the first byte",
                               registry=r)
        self.migrations = Counter(m.ROUTER_MIGRATIONS, "Streams continued on a fresh pair after a decode broke",
                                  registry=r)
        self.stream_holds = Counter(m.ROUTER_STREAM_HOLDS, "Fresh pairs tried by requests held for the "
                                    "restart of a worker that died under them (stream_hold_s)", registry=r)
        self.aborts = Counter(m.ROUTER_ABORTS, "Legs aborted by rid", ["role"], registry=r)
        self.pair_failures = Counter(m.ROUTER_PAIR_FAILURES, "Attempts that failed before the first byte",
                                     registry=r)
        self.connect_errors = Counter(m.ROUTER_CONNECTION_ERRORS,
                                      "Connection-level failures talking to a worker", ["worker"], registry=r)
        r.register(_PoolCollector(pool))
        self._finished = {}

    def finished(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        child = self._finished.get(key)
        if child is None:
            child = self._finished[key] = (self.requests.labels(route, str(status)), self.e2e.labels(route))
        child[0].inc()
        child[1].observe(seconds)
