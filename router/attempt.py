"""One try of a request on one prefill/decode pair: both legs started together, their fates tied here.

1. P's leg runs to its end in a kept background task (`Upstream.call`); D's request is sent at once
   beside it (prefill-first deadlocks: P waits for D to reserve KV).
2. `open_decode` returns D's response once its status line arrived. If P fails first, D is aborted and
   P's error raised; if D fails first, P is aborted and D's error raised. Either error says whether
   another pair may take the request (`RouterError.retryable`: the worker cannot have started it; P's connection
   lost at any point, since its answer is never the client's).
3. After that, a P failure (or either worker failing its health checks: `_worker_lost`) interrupts whoever reads D's body (`Interrupted(error)`), so a stream can end
   with P's error; `abort_both` / `abort_decode` / `abort_prefill` close what still runs and send
   `POST /abort_request` by rid (both, because each covers a gap of the other: a closed connection makes
   SGLang abort a request it is still answering; the rid reaches one the router gave up on).
4. Once D has the KV (P answered, or D streamed an event: a decode streams only once its KV arrived,
   `kv_delivered`), P's part is done: P lost from then on (its connection dropped, its answer late, its health checks
   failed) ends nothing; only P's own error answer still does.
"""

from __future__ import annotations

import asyncio
import json
import logging

import orjson

from .errors import RouterError, UpstreamTimeout, UpstreamUnreachable, unexpected
from .http_client import Interrupted, Response
from .pairing import PairedRequest
from .public import worker_text
from .state import RouterState
from .upstream import LegResult

log = logging.getLogger(__name__)


def dumps(body: dict) -> bytes:
    """JSON bytes of a leg's body: orjson (several times faster); json for what orjson refuses (ints past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


class Attempt:
    """Both legs of one PairedRequest."""

    def __init__(self, state: RouterState, req: PairedRequest) -> None:
        self._state, self.req = state, req
        self.body = dumps(req.body)
        self.decode: Response | None = None
        self.prefill_error: RouterError | None = None
        self._stop: object = None  # why D's reader must stop: P's error, or the client left
        self.decode_over = False  # D's part is settled: later P failures only get logged
        self.kv_delivered = False  # D has the KV (P answered, or D streamed: relay.py): P's loss ends nothing
        prefill_body = self.body if req.prefill_body is None else dumps(req.prefill_body)
        self.prefill = state.tasks.spawn(state.upstream.call(req.pair.prefill, req.path, prefill_body),
                                         name=f"prefill-{req.rid}")
        self.prefill.add_done_callback(self._prefill_done)
        req.pair.on_lost = self._worker_lost

    def _worker_lost(self, worker, why: str) -> None:
        """A worker of this pair stopped answering its health checks (hung, stopped): end this request now
        with an explicit error (an error event once streaming) instead of waiting on it; aborts go by rid.
        Retryable: before the first byte, a fresh pair may take the request. Not for a prefill whose part is done
        (`kv_delivered`): the decode has the KV and goes on without it."""
        if worker is self.req.pair.prefill and self.kv_delivered:
            log.warning("rid %s: %s %s after the decode had the KV; the request goes on", self.req.rid,
                        worker.describe(), why)
            return
        error = UpstreamUnreachable(f"{worker.describe()} {why} while serving this request; it was ended so "
                                    "that it does not hang", retryable=True,
                                    public=worker_text(worker.role, "stopped answering while serving this request"))
        if self.decode_over:
            self.abort_prefill()
        else:
            self.interrupt(error)

    def _prefill_done(self, task: asyncio.Task[LegResult]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            self.prefill_error = unexpected(f"the prefill leg of rid {self.req.rid}", error)
        elif task.result().error is not None:
            self.prefill_error = task.result().error
        else:
            self.kv_delivered = True
            self.req.pair.prefill_finished()
            return
        if isinstance(self.prefill_error, UpstreamUnreachable):
            # P's connection broke (the process died): another pair may take the request while nothing reached the
            # client, as after any connection failure. That P's head had come is no sign it started anything the
            # client could see: a streamed leg's 200 comes before its work, and its answer never reaches the client
            self.prefill_error.retryable = True
        if isinstance(self.prefill_error, UpstreamTimeout):
            self._send_abort(self.req.pair.prefill)
        if self.decode_over:
            log.warning("rid %s: decode already finished, but %s", self.req.rid, self.prefill_error.message)
        elif self.kv_delivered and isinstance(self.prefill_error, (UpstreamUnreachable, UpstreamTimeout)):
            log.warning("rid %s: the decode has the KV and streams on, but %s", self.req.rid,
                        self.prefill_error.message)   # P died or hangs after its KV went out: D needs it no more
        else:
            self.interrupt(self.prefill_error)

    def interrupt(self, reason: object) -> None:
        """Make whoever waits on D raise `Interrupted(reason)` (now, or as soon as D's request is out)."""
        if self._stop is None:
            self._stop = reason
            if self.decode is not None:
                self.decode.interrupt(reason)

    async def open_decode(self) -> Response:
        """D's response with its head read; raises the error of whichever leg failed first (the other aborted)."""
        upstream, decode = self._state.upstream, self.req.pair.decode
        try:
            self.decode = await upstream.send(decode, self.req.path, self.body)
            if self._stop is not None:
                self.decode.interrupt(self._stop)
            await upstream.wait_head(decode, self.decode)
        except Interrupted as exc:
            if isinstance(exc.reason, RouterError):  # P failed first
                self.abort_decode()
                raise exc.reason from None
            self.abort_both()  # the client left
            raise
        except BaseException:
            self.abort_both()
            raise
        return self.decode

    def _send_abort(self, worker) -> None:
        self._state.metrics.aborts.labels(worker.role.value).inc()
        self._state.tasks.spawn(self._state.upstream.abort(worker, self.req.rids),
                                name=f"abort-{worker.name}-{self.req.rid}")

    def abort_decode(self) -> None:
        """Close D's response if still open and abort D by rid."""
        self.decode_over = True
        if self.decode is None or not self.decode.complete:
            if self.decode is not None:
                self.decode.close()
            self._send_abort(self.req.pair.decode)

    async def prefill_settled(self, timeout_s: float) -> None:
        """Give P's leg up to `timeout_s` to end on its own once D failed. A dead prefill fails its leg at once
        (refused, or its connection lost), and that failure is what tells the pool the worker is gone; cancelled
        first, it is never seen, and a request whose decode answered 500 because the prefill it was paired with died
        ("KV bootstrap failed") was retried on the same dead prefill until `max_retries` ran out, instead of held
        for its restart."""
        if not self.prefill.done():
            await asyncio.wait({self.prefill}, timeout=timeout_s)

    def abort_prefill(self) -> None:
        """Abort P if it still runs on its worker (in flight, or given up on by a timeout)."""
        if not self.prefill.done():
            self.prefill.cancel()  # closes its connection
            self._send_abort(self.req.pair.prefill)

    def abort_both(self) -> None:
        self.abort_prefill()
        self.abort_decode()

    def finish(self) -> None:
        """D's part ended well: give its connection back; P drains on in the background if it must."""
        self.decode_over = True
        if self.decode is not None:
            self.decode.close()

    async def prefill_answer(self) -> LegResult:
        return await asyncio.shield(self.prefill)
