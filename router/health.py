"""The router's own health checks: each worker's `/health`, polled, moves it out of and back into the pool.

A worker leaves the pool after `health_failures_to_unhealthy` consecutive failed checks (no answer within
`health_check_timeout_s`, or a status other than 200) and comes back on the first check that passes. The
orchestrator reports state changes through the admin API as well; the two are independent (a worker is
paired only when both agree, `worker.Worker.eligible`), except that a READY report after another state counts
as a passed check: the supervisor's readiness probes just passed (`Worker.ready_again`). When a role's policy
weighs load or backpressure is on, each check also reads the worker's KV token usage (`sglang:token_usage`) and
its backlog from SGLang's own queue gauges for its role (`QUEUE_GAUGES`, every sample summed): on a PD decode the
requests waiting for KV pages (prealloc), for their KV to arrive (transfer) and to join the batch (waiting); on a
PD prefill those waiting for the decode's bootstrap and to be computed (waiting).
Under the prefill `prefix` policy each prefill's KV capacity is read once from its `/server_info` (again after a
restart): it sizes the policy's memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

from dsv4_cluster.core import Role

from .http_client import Interrupted, UpstreamError
from .policies import POLICIES
from .pool import WorkerPool
from .settings import RouterSettings
from .upstream import Upstream
from .worker import Worker

log = logging.getLogger(__name__)
TOKEN_USAGE = re.compile(rb"^sglang:token_usage(?:\{[^}]*\})? ([0-9.eE+-]+)", re.M)
QUEUE_GAUGES = {Role.PREFILL: ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_queue_reqs"),
                Role.DECODE: ("sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
                              "sglang:num_queue_reqs")}
_QUEUES = {role: re.compile(rb"^(?:" + b"|".join(re.escape(n.encode()) for n in names) +
                            rb")(?:\{[^}]*\})? ([0-9.eE+-]+)", re.M) for role, names in QUEUE_GAUGES.items()}


def queued(role: Role, metrics: bytes) -> int:
    """A worker's backlog from its `/metrics` text: every sample of its role's queue gauges, summed."""
    return int(sum(float(value) for value in _QUEUES[role].findall(metrics)))


class HealthChecker:
    """Polls every worker of the pool until cancelled."""

    def __init__(self, pool: WorkerPool, upstream: Upstream, settings: RouterSettings) -> None:
        self._pool, self._upstream = pool, upstream
        queues = settings.max_queued_per_worker > 0      # backpressure reads the queues from /metrics too
        self._reads_metrics = {Role.PREFILL: queues or POLICIES[settings.policy.prefill].weighs_load,
                               Role.DECODE: queues or POLICIES[settings.policy.decode].weighs_load}
        self._reads_capacity = settings.policy.prefill == "prefix"   # sizes its memory of each prefill
        self._interval_s = settings.health_check_interval_s
        self._timeout_s = settings.health_check_timeout_s
        self._threshold = settings.health_failures_to_unhealthy

    async def _passes(self, worker: Worker) -> bool:
        try:
            status, _ = await self._upstream.probe(worker, "/health", self._timeout_s)
            if status == 200 and self._reads_metrics[worker.role]:   # load and queue: what /metrics says, if it
                metrics, text = await self._upstream.probe(worker, "/metrics", self._timeout_s)   # answers
                found = TOKEN_USAGE.search(text) if metrics == 200 else None
                worker.token_usage = float(found.group(1)) if found else 0.0
                worker.queued = queued(worker.role, text) if metrics == 200 else 0
            if status == 200 and worker.kv_tokens is None and worker.role is Role.PREFILL and self._reads_capacity:
                worker.kv_tokens = await self._kv_capacity(worker)
        except (UpstreamError, Interrupted, asyncio.TimeoutError):
            return False
        return status == 200

    async def _kv_capacity(self, worker: Worker) -> int | None:
        """`max_total_num_tokens` from the worker's `/server_info` (SGLang's and the embedded engine's); None if it
        does not say, or does not answer (then it is asked again at the next check; the worker's health is
        `/health`'s alone)."""
        try:
            status, text = await self._upstream.probe(worker, "/server_info", self._timeout_s)
            value = json.loads(text).get("max_total_num_tokens") if status == 200 else None
        except (UpstreamError, Interrupted, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError,
                AttributeError):
            return None
        return value if isinstance(value, int) and value > 0 else None

    async def check(self, worker: Worker) -> None:
        """One check of one worker, and the transition it causes."""
        started = time.monotonic()
        if await self._passes(worker):
            if not worker.healthy:
                log.warning("%s at %s passes its health check again; back in the pool", worker.describe(), worker.url)
            worker.health_failures = 0
            worker.healthy = True
            worker.alive_at(started)
            return
        worker.health_failures += 1
        if worker.healthy and worker.health_failures >= self._threshold:
            worker.healthy = False
            log.warning("%s at %s failed %d health checks in a row; out of the pool until it passes; "
                        "ending (or moving to fresh pairs) the %d request%s it is part of", worker.describe(),
                        worker.url, worker.health_failures, len(worker.pairs), "" if len(worker.pairs) == 1 else "s")
            worker.lost(f"failed {worker.health_failures} health checks in a row")

    async def run(self) -> None:
        """A round every `health_check_interval_s`, however long the last one waited on a timeout: a hung worker
        is out (and its requests ended) within interval + (failures - 1) x interval + timeout."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.gather(*(self.check(w) for w in self._pool.workers))
            await asyncio.sleep(max(0.0, self._interval_s - (loop.time() - started)))
