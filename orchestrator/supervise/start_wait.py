"""Waiting for supervisors' `start` calls made at once: each READY row as it comes, and once one fails, a short grace
for the others to say how they fare. A worker that fails at once (a bad flag, a port taken) is reported in seconds,
not after the others finished loading their models (minutes for SGLang on a large model); those still starting are
named as such, and the caller stops everything.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from dsv4_cluster.core import WorkerStatus

FAIL_GRACE_S = 2.0  # after a first failure: how long the others may still take to fail (or be READY) on their own


def cause_text(err: BaseException) -> str:
    if isinstance(err, RayTaskError):
        return str(err.cause) if err.cause is not None else str(err)
    return str(err)


def wait_started(calls: dict[str, Any], grace_s: float = FAIL_GRACE_S,
                 wait: Callable[..., tuple[list, list]] = ray.wait,
                 get: Callable[[Any], WorkerStatus] = ray.get) -> tuple[list[WorkerStatus], list[str]]:
    """`calls`: each process's name -> its pending `start` (an object ref). Returns the READY rows and the failures,
    one line each in `calls`' order: each error, then those still starting when the first came."""
    names = {ref: name for name, ref in calls.items()}
    pending, rows, failed = list(calls.values()), [], {}
    deadline = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break   # the grace is over
        for ref in done:
            try:
                rows.append(get(ref))
            except (RayTaskError, RayActorError) as e:
                failed[names[ref]] = cause_text(e)
                deadline = deadline or time.monotonic() + grace_s
    starting = {names[ref] for ref in pending}
    return rows, [f"{name}: {failed[name]}" for name in calls if name in failed] + [
        f"{name}: still starting when the failure above stopped the cluster" for name in calls if name in starting]
