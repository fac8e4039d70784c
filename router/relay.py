"""One streaming answer: D's SSE events relayed to the client as they arrive, on event boundaries
(docs/router.md, "What a request goes through", 4). Helpers of the request that owns the stream (`Flight.relay` runs
the loop over attempts and decides each step below; these frame, check and hand it the events).

  1. Nothing is sent before D's first event: until then a retryable failure moves the request to a fresh pair
     (`Flight.may_retry`), any other answers with its status. From it on, what one wake-up brought is framed in
     one pass and sent in one write (`forward`).
  2. D's `[DONE]` ends the stream. An error event before anything was sent is a failed attempt
     (`_worker_errors`); after that it is rewritten (502-class code, the role's text), P is aborted and the
     stream ends with `[DONE]`.
  3. D's stream breaks (the decode died), or a worker of the attempt is lost (D failed its health checks: stopped,
     or restarted without a drain): `migration.py` continues it while `migration_limit` allows, otherwise P is
     aborted and the stream ends with an error event and `[DONE]`.
  4. P answers with an error while D streams: D is aborted, the stream ends with P's error event and `[DONE]`. P
     lost once D streams (its connection dropped, its health checks failed) ends nothing: D has the KV
     (`Attempt.kv_delivered`).
  5. The client leaves: both legs are aborted, nothing more is sent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import logprobs, sse
from .errors import RouterError, UpstreamUnreachable
from .http_client import Interrupted, UpstreamError
from .public import worker_text
from .upstream import event_status, worker_failed

if TYPE_CHECKING:
    from .attempt import Attempt
    from .migration import Migration
    from .stream import StreamOwner

log = logging.getLogger(__name__)


class StreamBroke(Exception):
    """D's stream ended without `[DONE]`: the decode worker died or dropped the connection."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


def failure_of(exc: BaseException) -> RouterError | None:
    """The RouterError a relay failure carries; None when the client left."""
    if isinstance(exc, StreamBroke):
        return exc.error
    if isinstance(exc, Interrupted):
        return exc.reason if isinstance(exc.reason, RouterError) else None
    return exc if isinstance(exc, RouterError) else None


def continues(exc: BaseException, error: RouterError) -> bool:
    """Whether a failure after the first byte is continued on a fresh pair (step 3): D's stream broke (it died), or a
    worker of the attempt is lost (`Attempt._worker_lost`: D failed its health checks, stopped or restarting; or P,
    on a continuation whose decode has not streamed yet). The client has whole events only, so the seam is exact."""
    return isinstance(exc, StreamBroke) or (isinstance(error, UpstreamUnreachable) and error.retryable)


def _worker_errors(flight: StreamOwner, attempt: Attempt, events: list[bytes]) -> tuple[list[bytes], bool]:
    """Step 2 for error events among `events`: raises the worker's error while nothing was sent, else returns the
    events up to the first error, that error rewritten for the client, and `[DONE]` (True: the stream is over)."""
    for i, event in enumerate(events):
        error = sse.error_in(event) if b'"error"' in event else None
        if error is None:
            continue
        failure = worker_failed(attempt.req.pair.decode, event_status(error), str(error.get("message", error)),
                                flight.state.upstream.redact)
        if flight.status == 0 and i == 0:   # nothing reached the client, and nothing of this run goes before it
            raise failure
        log.warning("rid %s: %s (mid-stream; the stream ends)", attempt.req.rid, failure.message)
        attempt.abort_prefill()
        return events[:i] + [sse.error_event(failure.body()), sse.DONE], True
    return events, b"[DONE]" in events[-1] and sse.is_done(events[-1])


async def pump(flight: StreamOwner, attempt: Attempt, migration: Migration) -> None:
    """Relay D's events until `[DONE]`, whose batch also ends the client's body (one write fewer);
    raises StreamBroke, Interrupted, or RouterError (timeout)."""
    state = flight.state
    decode, worker = attempt.decode, attempt.req.pair.decode
    timeout_s = state.upstream.request_timeout_s
    framer = sse.Framer()
    merge = None
    if logprobs.wanted(flight.path, attempt.req.body):
        prefill = await attempt.prefill_answer()
        if not prefill.ok:
            raise Interrupted(prefill.error)
        merge = logprobs.final_answer(prefill.content)
    done = False
    while not done:
        try:
            data = await decode.next_data(timeout_s)
        except UpstreamError as exc:
            error = state.upstream.transport_error(worker, exc)
            if isinstance(error, UpstreamUnreachable):
                worker.record(ok=False)   # a held stream waits for its restart (Worker.answering)
                raise StreamBroke(error) from None
            raise error from None
        if data is None:
            worker.record(ok=False)
            raise StreamBroke(UpstreamUnreachable(f"{worker.describe()} ended its stream without 'data: [DONE]'",
                                                  public=worker_text(worker.role, "ended its stream early")))
        done = await forward(flight, attempt, migration, framer.feed(data), merge)


async def forward(flight: StreamOwner, attempt: Attempt, migration: Migration, run: bytes, merge: object) -> bool:
    """Send one run of complete events (all that one wake-up brought) to the client in one write, with one timing
    observation; True when it held `[DONE]` (the write also ended the body). Events are split out only when the run
    may hold `[DONE]` or an error (step 2: `_worker_errors`), or logprobs must be merged."""
    if not run:
        return False
    if merge is not None:
        run = b"".join(logprobs.merge_event(merge, e) for e in sse.events(run))
    done = False
    if b'"error"' in run:
        events, done = _worker_errors(flight, attempt, sse.events(run))
        run = b"".join(events)
    elif b"[DONE]" in run:   # the common end of a stream: its last event is `data: [DONE]` alone
        tail = run.rstrip()
        done = tail == b"data: [DONE]" or tail.endswith(b"\n\ndata: [DONE]") or sse.is_done(sse.events(run)[-1])
    attempt.kv_delivered = True   # D streams, so it has the KV: P's part is done (`Attempt`, 4)
    await flight.send_events(migration.outgoing(run), done)
    return done
