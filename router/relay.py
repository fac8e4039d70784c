"""One streaming PD exchange: decode's SSE stream relayed to the client, prefill drained beside it.

Lifecycle:
  1. Start P's leg (drained to the end in a kept background task) and open D's stream, concurrently.
  2. P fails before D's headers arrive -> abort D; the client gets P's error as a normal error response.
     D cannot be reached or answers non-2xx -> abort P; the client gets that error / D's status and body.
  3. Otherwise the client gets D's status and its events one by one, as they arrive.
  4. P fails while D still streams -> abort D, end the stream with an error event and `data: [DONE]`.
     D's stream breaks or ends without `[DONE]` -> abort P, end the same way.
  5. The client disconnects -> abort both legs that are still running.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import httpx
from fastapi import Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from . import logprobs, sse
from .errors import RouterError, UpstreamUnreachable
from .aborts import abort_if_timed_out, abort_leg, abort_prefill
from .pairing import PairedRequest
from .tasks import TaskSet
from .upstream import LegResult, Upstream, transport_error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _End:
    """The last item of a relay's queue; `error` is emitted as an error event before `[DONE]`."""

    error: RouterError | None


class StreamRelay:
    """Moves D's events to the client and ties the two legs' fates together."""

    def __init__(self, upstream: Upstream, tasks: TaskSet, req: PairedRequest,
                 decode: httpx.Response, prefill: asyncio.Task[LegResult]) -> None:
        self._upstream, self._tasks, self._req = upstream, tasks, req
        self._decode, self._prefill = decode, prefill
        self._queue: asyncio.Queue[bytes | _End] = asyncio.Queue()
        self._decode_ended = False
        self._finished = False
        self._pump = tasks.spawn(self._pump_decode(), name=f"relay-{req.rid}")
        prefill.add_done_callback(self._prefill_done)

    async def _pump_decode(self) -> None:
        try:
            prefill_answer = None
            if logprobs.wanted(self._req.path, self._req.body):
                prefill = await asyncio.shield(self._prefill)
                if not prefill.ok:
                    return  # _prefill_done aborts D and ends the stream
                prefill_answer = logprobs.final_answer(prefill.content)
            end = await self._relay_events(prefill_answer)
        except Exception as exc:
            self._queue.put_nowait(_End(RouterError(f"router failed relaying rid {self._req.rid}: {exc!r}")))
            raise
        finally:
            await self._decode.aclose()
        self._queue.put_nowait(end)

    async def _relay_events(self, prefill_answer: object) -> _End:
        """Queue D's events until its stream ends; how it ended decides whether P is aborted."""
        decode = self._req.pair.decode
        end = _End(UpstreamUnreachable(f"{decode.describe()} ended its stream without 'data: [DONE]'"))
        try:
            async for event in sse.events(self._decode.aiter_raw()):
                self._queue.put_nowait(logprobs.merge_event(prefill_answer, event) if prefill_answer else event)
                if sse.is_done(event) or sse.error_in(event) is not None:
                    end = _End(None)
                if sse.error_in(event) is not None:
                    self._abort_prefill(f"{decode.describe()} streamed an error")
        except httpx.HTTPError as exc:
            end = _End(transport_error(decode, exc, self._upstream.request_timeout_s))
            abort_if_timed_out(self._upstream, self._tasks, decode, self._req, end.error)
        self._decode_ended = True
        if end.error is not None:
            self._abort_prefill(end.error.message)
        return end

    def _abort_prefill(self, why: str) -> None:
        if not self._prefill.done():
            log.info("rid %s: %s; aborting prefill", self._req.rid, why)
            abort_leg(self._upstream, self._tasks, self._req.pair.prefill, self._req, self._prefill)

    def _prefill_done(self, task: asyncio.Task[LegResult]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            error = RouterError(f"router failed draining the prefill leg of rid {self._req.rid}: {task.exception()!r}")
        elif task.result().error is not None:
            error = task.result().error
        else:
            return
        abort_if_timed_out(self._upstream, self._tasks, self._req.pair.prefill, self._req, error)
        if self._decode_ended or self._finished:
            log.warning("rid %s: decode already finished, but %s", self._req.rid, error.message)
            return
        abort_leg(self._upstream, self._tasks, self._req.pair.decode, self._req, self._pump)
        self._queue.put_nowait(_End(error))

    async def body(self) -> AsyncIterator[bytes]:
        """The client's stream: D's events, then (on failure) an error event and `[DONE]`."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, bytes):
                    yield item
                    continue
                self._finished = True
                if item.error is not None:
                    yield sse.error_event(item.error.body())
                    yield sse.DONE
                return
        finally:
            self.release()

    async def finish(self) -> None:
        """The response's background task: `release` on the event loop (a sync one would run in a thread)."""
        self.release()

    def release(self) -> None:
        """Called when the client's response ends, however it ends; aborts whatever still runs."""
        self._req.pair.release()
        if self._finished:
            return
        self._finished = True
        log.info("rid %s: client left mid-stream, aborting both legs", self._req.rid)
        if not self._pump.done():
            abort_leg(self._upstream, self._tasks, self._req.pair.decode, self._req, self._pump)
        self._abort_prefill("client left")


async def _open_decode(upstream: Upstream, tasks: TaskSet, req: PairedRequest,
                       prefill: asyncio.Task[LegResult]) -> httpx.Response:
    """D's response headers; or the error of the leg that failed first, with the other leg aborted."""
    pair = req.pair
    opening = asyncio.create_task(upstream.open_stream(pair.decode, req.path, req.body), name=f"decode-{req.rid}")
    try:
        await asyncio.wait({prefill, opening}, return_when=asyncio.FIRST_COMPLETED)
        if opening.done() or prefill.result().ok:
            return await opening
    except BaseException as exc:
        opening.cancel()
        abort_if_timed_out(upstream, tasks, pair.decode, req, exc if isinstance(exc, RouterError) else None)
        abort_prefill(upstream, tasks, req, prefill)
        raise
    error = prefill.result().error
    abort_if_timed_out(upstream, tasks, pair.prefill, req, error)
    abort_leg(upstream, tasks, pair.decode, req, opening)
    raise error


async def relay(upstream: Upstream, tasks: TaskSet, req: PairedRequest) -> Response:
    """Run one streaming request: steps 1-3 here, the rest in StreamRelay."""
    pair = req.pair
    prefill = tasks.spawn(upstream.call(pair.prefill, req.path, req.body), name=f"prefill-{req.rid}")
    decode = await _open_decode(upstream, tasks, req, prefill)
    if not decode.is_success or not decode.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            content = await decode.aread()
        except httpx.HTTPError as exc:
            abort_prefill(upstream, tasks, req, prefill)
            raise transport_error(pair.decode, exc, upstream.request_timeout_s) from exc
        finally:
            await decode.aclose()
        if not decode.is_success:
            abort_prefill(upstream, tasks, req, prefill)
        return Response(content, status_code=decode.status_code, media_type=decode.headers.get("content-type"))
    stream = StreamRelay(upstream, tasks, req, decode, prefill)
    return StreamingResponse(stream.body(), status_code=decode.status_code,
                             media_type=decode.headers.get("content-type"),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(stream.finish))
