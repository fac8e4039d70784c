"""One non-streaming PD exchange: both legs at once, decode's answer to the client.

Lifecycle:
  1. POST the paired body to P and D concurrently (prefill-first deadlocks: P waits for D's KV slots).
  2. P fails first (error status, transport error) -> abort D by rid, the client gets P's error.
  3. D fails -> abort P if it is still running; the client gets D's status and body.
  4. D succeeds -> wait for P's answer too (it finished before D could decode), then answer with D's
     body (for `/generate` with `return_logprob`, P's input logprobs go in front: `logprobs.py`).
  5. The client disconnects -> abort both legs; nobody is left to answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from fastapi import Response

from . import logprobs
from .aborts import abort_if_timed_out, abort_leg, abort_prefill
from .pairing import PairedRequest
from .tasks import TaskSet
from .upstream import LegResult, Upstream

log = logging.getLogger(__name__)
Receive = Callable[[], Awaitable[dict[str, Any]]]


async def client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (the body was already read, so nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        continue


def decode_response(req: PairedRequest, decode: LegResult, prefill: LegResult | None) -> Response:
    """D's status and body; `/generate` with `return_logprob` gets P's input logprobs in front."""
    content = decode.content
    if logprobs.wanted(req.path, req.body) and prefill is not None and prefill.ok:
        content = logprobs.merge_body(prefill.content, decode.content)
    return Response(content, status_code=decode.status, media_type=decode.content_type or None)


async def exchange(upstream: Upstream, tasks: TaskSet, req: PairedRequest, receive: Receive) -> Response:
    """Run both legs of one non-streaming request and answer with decode's response."""
    pair = req.pair
    p_leg = asyncio.create_task(upstream.call(pair.prefill, req.path, req.body), name=f"prefill-{req.rid}")
    d_leg = asyncio.create_task(upstream.call(pair.decode, req.path, req.body), name=f"decode-{req.rid}")
    gone = asyncio.create_task(client_gone(receive), name=f"client-{req.rid}")
    try:
        while True:
            running = {task for task in (p_leg, d_leg, gone) if not task.done()}
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if d_leg.done():
                decode = d_leg.result()
                if not decode.ok:
                    abort_if_timed_out(upstream, tasks, pair.decode, req, decode.error)
                    abort_prefill(upstream, tasks, req, p_leg)
                    if decode.status:
                        return Response(decode.content, status_code=decode.status,
                                        media_type=decode.content_type or None)
                    raise decode.error
                prefill = await p_leg
                if not prefill.ok:
                    log.warning("rid %s: decode succeeded but %s", req.rid, prefill.error.message)
                return decode_response(req, decode, prefill)
            if p_leg.done() and not p_leg.result().ok:
                abort_if_timed_out(upstream, tasks, pair.prefill, req, p_leg.result().error)
                abort_leg(upstream, tasks, pair.decode, req, d_leg)
                raise p_leg.result().error
            if gone.done():
                log.info("rid %s: client disconnected, aborting both legs", req.rid)
                abort_leg(upstream, tasks, pair.prefill, req, p_leg)
                abort_leg(upstream, tasks, pair.decode, req, d_leg)
                return Response(status_code=499)
    finally:
        for task in (p_leg, d_leg, gone):
            task.cancel()
