"""Aborting one leg of a PD pair: cancel the router's HTTP call and `POST /abort_request` by rid.

Both, because each covers a gap of the other: closing the connection makes SGLang abort a request it
is still answering, and the abort by rid reaches a request whose connection the router never opened
or already gave up on (a timeout). Aborts run in the app's TaskSet, so that a cancelled handler
(client gone) still sends them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .errors import RouterError, UpstreamTimeout
from .pairing import PairedRequest
from .pool import Worker
from .tasks import TaskSet
from .upstream import LegResult, Upstream

log = logging.getLogger(__name__)


def abort_leg(upstream: Upstream, tasks: TaskSet, worker: Worker, req: PairedRequest,
              leg: asyncio.Task[Any] | None = None) -> None:
    """Cancel the leg's HTTP call (closing its connection) and POST /abort_request by rid, in the background."""
    if leg is not None and not leg.done():
        leg.cancel()
    log.info("aborting rid %s on %s", req.rid, worker.describe())
    tasks.spawn(upstream.abort(worker, req.rids), name=f"abort-{worker.name}-{req.rid}")


def abort_if_timed_out(upstream: Upstream, tasks: TaskSet, worker: Worker, req: PairedRequest,
                       error: RouterError | None) -> None:
    """A leg the router gave up waiting for is still running on its worker: abort it there too."""
    if isinstance(error, UpstreamTimeout):
        abort_leg(upstream, tasks, worker, req)


def abort_prefill(upstream: Upstream, tasks: TaskSet, req: PairedRequest, leg: asyncio.Task[LegResult]) -> None:
    """After D failed: abort P if it still runs on its worker (in flight, or given up on by a timeout)."""
    if not leg.done():
        abort_leg(upstream, tasks, req.pair.prefill, req, leg)
    elif not leg.cancelled() and leg.exception() is None:
        abort_if_timed_out(upstream, tasks, req.pair.prefill, req, leg.result().error)
