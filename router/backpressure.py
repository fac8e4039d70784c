"""Per-stage backpressure: admission refuses a request that no worker of a stage could start soon.

Each health check also reads the worker's backlog from SGLang's own queue gauges for its role (`health.py`,
`QUEUE_GAUGES`: a PD decode's prealloc + transfer + waiting queues, a PD prefill's bootstrap + waiting queues; the
embedded engine exports the same names). A stage (prefill or decode) is saturated when every eligible worker of it has at least
`max_queued_per_worker` queued; then a new request would only wait in a queue (and hold the other stage's KV
meanwhile), so the router answers 503 at once, before touching any worker, with Retry-After from the worse stage:
    retry_after_s = clamp(ceil(health_check_interval_s x min_queued / max_queued_per_worker), 1, 30)
(the more a stage is over its limit, the longer; at the limit, one health-check interval). `max_queued_per_worker`
0 turns it off. A worker's own 429/503 answers never open its breaker: that counts connection failures only.
"""

from __future__ import annotations

import math

from dsv4_cluster.core import Role

from .errors import Saturated

MAX_RETRY_AFTER_S = 30


def check_stages(state) -> None:
    """Raise Saturated when a stage's every eligible worker is at or over its queue limit."""
    limit = state.settings.max_queued_per_worker
    if limit <= 0:
        return
    worst: tuple[float, Role, int] | None = None
    for role, workers in ((Role.PREFILL, state.pool.prefill), (Role.DECODE, state.pool.decode)):
        queued = [w.queued for w in workers if w.eligible]
        if queued and min(queued) >= limit:
            over = min(queued) / limit
            if worst is None or over > worst[0]:
                worst = (over, role, min(queued))
    if worst is None:
        return
    over, role, queued = worst
    retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(state.settings.health_check_interval_s * over)))
    raise Saturated(f"every {role} worker has {queued} or more requests queued (max_queued_per_worker "
                    f"{limit}); retry in {retry} s", retry)
