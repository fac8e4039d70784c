"""The generation routes (`/v1/chat/completions`, `/v1/completions`, `/generate`), served as plain ASGI.

Why plain ASGI: FastAPI's routing, request and response machinery (its StreamingResponse runs a task
group per response) cost more per request than everything else the router does; the other routes stay
on FastAPI (`app.py` sends only these three POST paths here).

Lifecycle of one request (a `Flight`; docs/router.md, "What a request goes through", has each rule in full):
  1. Body (413), API key (401), admission (`admission.py`: 400 naming the field, 404), before any worker is touched.
  2. A pair (503 + Retry-After when a pool has no eligible worker); fresh rid and bootstrap room.
  3. Both legs at once (`attempt.py`). A failure the worker cannot have started (connection-level, before D's
     status line; for a stream, before its first event) aborts both legs and tries a fresh pair, at most
     `max_retries` times, or holds the request for the worker's restart (`hold`); never once a byte went out.
  4. Not streaming: D's status and body (P's error if P failed first). Streaming: `relay.py`.
  5. The client leaves at any point: both legs are aborted; nothing is sent.
  6. A router bug is caught here (`Flight.fail`): a 500 in the OpenAI envelope with a request id, or, once a
     stream started, an error event and `[DONE]`; the exception goes to the log under that id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from . import logprobs, sse
from .admission import admit, read_body
from .attempt import Attempt
from .errors import NoWorkers, RouterError, UpstreamFailed, error_response, unexpected
from .http_client import Interrupted, UpstreamError
from .backpressure import check_stages
from .pairing import pair_request
from .migration import Migration, resumable
from .prefix_tree import prompt_text
from .relay import StreamBroke, continues, failure_of, pump
from .resume import prefill_asks, with_ids
from .state import RouterState
from .worker import Worker

log = logging.getLogger(__name__)
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
HOLD_POLL_S = 0.1  # while a request is held for a worker's restart, how often the pool is looked at (no legs sent)
HOLD_TRY_S = 1.0  # and at most one try (one prefill leg) per held request per this long
PREFILL_SETTLE_S = 0.25  # a decode failed (5xx): how long its prefill leg may take to show its own fate (`Attempt`)
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class ClientGone:
    """The reason an attempt is interrupted when the client disconnected."""

    def __str__(self) -> str:
        return "the client disconnected"


CLIENT_GONE = ClientGone()


def streams(attempt: Attempt) -> bool:
    """Whether the attempt's decode answered 200 with an event stream."""
    return attempt.decode.ok and attempt.decode.content_type.startswith("text/event-stream")


async def send_response(send: Send, status: int, body: bytes, content_type: str = "application/json",
                        headers: dict[str, str] | None = None) -> None:
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Flight:
    """One client request, from its body to the last byte the client gets, across attempts."""

    def __init__(self, state: RouterState, path: str, receive: Receive, send: Send) -> None:
        self.state, self.path, self.receive, self.send = state, path, receive, send
        self.started = time.perf_counter()
        self.attempt: Attempt | None = None
        self.body: dict[str, Any] = {}
        self.upstream: dict[str, Any] = {}   # what the workers get: the body, plus the token ids a resume needs
        self.ids_asked = False               # the router asked for them (the client did not): out of every event
        self.resumable = False               # a stream continued when its decode dies (`migration.resumable`)
        self.gone = False
        self.status = 0
        self.retries = 0  # fresh pairs tried so far, across the whole request
        self._last_sent: float | None = None

    def token_sent(self) -> None:
        """Timing of a streamed batch of events: TTFT for the first, inter-token latency after."""
        now = time.perf_counter()
        metrics = self.state.metrics
        if self._last_sent is None:
            metrics.ttft.observe(now - self.started)
        else:
            metrics.itl.observe(now - self._last_sent)
        self._last_sent = now

    def client_gone(self, _: object = None) -> None:
        self.gone = True
        if self.attempt is not None:
            self.attempt.interrupt(CLIENT_GONE)

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            continue

    def may_retry(self, error: RouterError) -> bool:
        """Whether a failure before the first byte is tried again on a fresh pair (and count it if so)."""
        if not error.retryable or self.retries >= self.state.settings.max_retries or self.gone:
            return False
        self.retries += 1
        self.state.metrics.retries.inc()
        return True

    async def start(self, body: dict[str, Any], avoid: set[Worker] | None = None, failed: RouterError | None = None,
                    counted: bool = True) -> Attempt:
        """An attempt whose D answered with a status line. Workers in `avoid` are taken only when no other is
        eligible. A failure another pair may take (retryable; `failed`: one the caller saw) is tried again at once
        while an eligible pair answers (`max_retries`, counted unless `counted` is False: a migration), else the
        request is held for the worker's restart (`hold`); once a request failed in flight, no eligible worker
        holds it too, while a new request gets its 503 at once."""
        avoid = set(avoid or ())
        prompt = prompt_text(self.path, body) if self.state.settings.policy.prefill == "prefix" else None
        deadline: float | None = None
        while True:
            if failed is not None:
                if not (failed.retryable or isinstance(failed, NoWorkers)):
                    raise failed
                if not self.state.pool.answering_pair():
                    deadline = await self.hold(failed, deadline)
                elif counted and not self.may_retry(failed):
                    raise failed
            counted = True
            try:
                pair = self.state.pool.pick(frozenset(avoid), prompt)
            except NoWorkers as exc:
                if failed is None:
                    raise
                failed = exc
                continue
            asks = prefill_asks(self.path, body) if self.resumable else None
            self.attempt = attempt = Attempt(self.state, pair_request(self.path, body, pair, asks))
            if self.gone:
                attempt.interrupt(CLIENT_GONE)
            try:
                await attempt.open_decode()
                return attempt
            except RouterError as exc:
                pair.release()
                self.state.metrics.pair_failures.inc()
                avoid |= {pair.prefill, pair.decode}
                failed = exc
            except BaseException:
                pair.release()
                raise

    async def hold(self, error: RouterError, deadline: float | None) -> float:
        """Wait for an eligible pair that answers (the restarted worker: its supervisor's READY report or a passed
        health check), looking every HOLD_POLL_S without sending anything, and at most one try (one prefill leg)
        per HOLD_TRY_S; raises `error` at the deadline (`stream_hold_s` after the hold began) or when the client
        left, and the pool's 503 (without Retry-After) once a pool has no worker that may come back without the
        operator (FAILED or drained: nothing to wait for). Returns the deadline."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + self.state.settings.stream_hold_s if deadline is None else deadline
        next_try = now + HOLD_TRY_S
        while loop.time() < next_try or not self.state.pool.answering_pair():
            if (refusal := self.state.pool.unavailable()) is not None and not refusal.soon:
                raise refusal   # a pool no worker will come back to without the operator: nothing to wait for
            if self.gone or loop.time() + HOLD_POLL_S > deadline:
                raise error
            await asyncio.sleep(HOLD_POLL_S)
        self.state.metrics.stream_holds.inc()
        return deadline

    async def run(self, scope: Scope) -> None:
        state = self.state
        watch: asyncio.Task[None] | None = None
        cycle = getattr(self.receive, "__self__", None)
        cycle = cycle if hasattr(cycle, "on_lost") else None
        try:
            raw = await read_body(self.receive, scope, state.settings.max_body_bytes)
            self.body, stream = admit(state, self.path, scope, raw)
            check_stages(state)
            if cycle is not None:    # the router's own protocol tells of a lost connection (server_protocol.py)
                cycle.on_lost = self.client_gone
                if cycle.disconnected:
                    self.client_gone()
            else:                    # any other ASGI server: a task waits for its http.disconnect
                watch = asyncio.get_running_loop().create_task(self._watch())
                watch.add_done_callback(self.client_gone)
            self.resumable = stream and resumable(state.settings, self.path, self.body)
            self.upstream, self.ids_asked = with_ids(self.path, self.body) if self.resumable else (self.body, False)
            attempt = await self.start(self.upstream)
            try:
                if stream and streams(attempt):
                    await self.relay(attempt)
                else:
                    await self.answer(attempt)
            finally:
                attempt.req.pair.release()
                self.attempt.req.pair.release()  # a migrated stream's last pair
        except Interrupted:
            self.status = 499  # the client left: nobody to answer
        except RouterError as exc:
            await self.fail(exc)
        except Exception as exc:   # the catch-all: never uvicorn's plain-text 500, never a stream cut short
            await self.fail(unexpected(self.path, exc))
        finally:
            if cycle is not None:
                cycle.on_lost = None
            if watch is not None:
                watch.remove_done_callback(self.client_gone)
                watch.cancel()
            state.metrics.finished(self.path, self.status, time.perf_counter() - self.started)

    async def relay(self, attempt: Attempt) -> None:
        """D's events to the client (`relay.py`, steps 1-5); a failure before the first byte tries a fresh pair as
        for any first attempt, one after it continues the stream on one (`migration.py`) or ends it with an error
        event. The pair of each attempt is released by `run`."""
        migration = Migration(self)
        while True:
            try:
                await pump(self, attempt, migration)
                attempt.finish()
                return
            except (StreamBroke, Interrupted, RouterError) as exc:
                attempt.abort_both()
                if (error := failure_of(exc)) is None:
                    raise  # the client left
                if isinstance(exc, StreamBroke):
                    error.retryable = True   # a broken stream can go on elsewhere: tried again, or continued
                if self.status == 0:  # nothing sent yet
                    self.state.metrics.pair_failures.inc()
                    if not error.retryable or self.gone:
                        raise error from None
                    pair = attempt.req.pair
                    pair.release()
                    avoid = {pair.decode} | ({pair.prefill} if error is attempt.prefill_error else set())
                    attempt = await self.start(self.upstream, avoid=avoid, failed=error)
                    if not streams(attempt):
                        return await self.answer(attempt)  # D's answer or error, as for any first attempt
                elif not continues(exc, error) or (attempt := await self._migrate(migration, attempt, error)) is None:
                    raise error from None   # `fail`: an error event and `[DONE]`

    async def _migrate(self, migration: Migration, old: Attempt, broke: RouterError) -> Attempt | None:
        """The stream continued on a fresh pair (held for a restart when its only decode died); None: it cannot."""
        body = None if self.gone else migration.continuation(old, broke)
        if body is None:
            return None
        try:
            attempt = await self.start(body, avoid={old.req.pair.decode}, failed=broke, counted=False)
        except RouterError:
            return None
        finally:
            old.req.pair.release()
        if not streams(attempt):
            attempt.abort_both()
            return None
        migration.continued()
        return attempt

    async def send_events(self, run: bytes, done: bool) -> None:
        """A run of the stream's events in one write, after the response head for the first; `done`: it ends the
        body."""
        if self.status == 0:
            self.status = 200
            await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.token_sent()
        await self.send({"type": "http.response.body", "body": run, "more_body": not done})

    async def fail(self, error: RouterError) -> None:
        """`error` to the client: its status and body while nothing was sent, else an error event and `[DONE]`."""
        if self.status == 0:
            self.status = error.status
            await send_response(self.send, *error_response(error))
            return
        try:
            await self.send({"type": "http.response.body", "body": sse.error_event(error.body()) + sse.DONE,
                             "more_body": False})
        except Exception:   # the response was already complete, or the client went away: nothing left to tell
            log.warning("could not end the stream with %s", error.message)

    async def answer(self, attempt: Attempt) -> None:
        """D's whole answer to the client. A plain request whose attempt failed while nothing was sent is tried
        again like one (`start`): D's retryable 5xx, or P lost after D's status line arrived (its connection dropped,
        or it stopped answering its health checks); anything else raises its error."""
        while True:
            try:
                return await self._answer(attempt)
            except RouterError as exc:
                if not exc.retryable or self.status or self.body.get("stream"):
                    raise
                pair = attempt.req.pair
                pair.release()
                avoid = {pair.decode} if isinstance(exc, UpstreamFailed) and exc is not attempt.prefill_error else \
                    {pair.prefill, pair.decode}
                attempt = await self.start(self.body, avoid=avoid, failed=exc)

    async def _answer(self, attempt: Attempt) -> None:
        """D's whole answer (or its error status and body) to the client."""
        decode, worker = attempt.decode, attempt.req.pair.decode
        try:
            content = await decode.read(self.state.upstream.request_timeout_s)
        except Interrupted as exc:
            attempt.abort_both()
            if isinstance(exc.reason, RouterError):
                raise exc.reason from None
            raise
        except UpstreamError as exc:
            attempt.abort_both()
            raise self.state.upstream.transport_error(worker, exc) from None
        attempt.finish()
        if not decode.ok:      # the client gets it in the OpenAI envelope: 4xx as is, a worker's failure as 502/503
            if decode.status >= 500:
                await attempt.prefill_settled(PREFILL_SETTLE_S)
            attempt.abort_prefill()
            raise self.state.upstream.failed(worker, decode.status, content)
        if logprobs.wanted(self.path, attempt.req.body):
            prefill = await attempt.prefill_answer()
            if prefill.ok:
                content = logprobs.merge_body(prefill.content, content)
        self.status = decode.status
        await send_response(self.send, decode.status, content, decode.content_type or "application/json", None)


def is_generation(scope: Scope) -> bool:
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in PATHS


async def serve_generation(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    await Flight(state, scope["path"], receive, send).run(scope)

