"""The router's HTTP/1.1 client to its workers: keep-alive connections over asyncio, parsed by httptools.

Why not httpx: its pool does O(pool) bookkeeping on every request event (`is_idle` over every
connection), which dominated a profile of the router under load. This client keeps, per worker, a
stack of idle connections (O(1) to take and give back), writes each request with one `write`, and
parses responses with httptools (llhttp, the parser uvicorn serves with).

Failures are typed so that the caller can decide about retries: `ConnectFailed` (the worker was never
reached), `ConnectionLost` with `before_response` (no status line arrived: the request may be retried on
another worker) and `reused` (the classic keep-alive race: the worker closed an idle connection just as
the request went out), and `ReadTimeout`. Idle connections are dropped after `keepalive_s`, kept shorter
than the workers' own keep-alive (uvicorn closes after 5 s) so that the race stays rare; when it
happens anyway, the caller retries.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

TIMER_SLACK_S = 0.002  # a timer that fires this close to its deadline counts as on time


class UpstreamError(Exception):
    """A transport-level failure talking to a worker."""


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, connect timeout): the worker saw nothing."""


class ConnectionLost(UpstreamError):
    """The connection closed or broke before the response was complete."""

    def __init__(self, message: str, before_response: bool, reused: bool) -> None:
        super().__init__(message)
        self.before_response = before_response
        self.reused = reused


class ReadTimeout(UpstreamError):
    """The worker did not send the next part of its response in time."""


class Interrupted(Exception):
    """Raised into a response's reader by `Response.interrupt` (another leg failed, the client left)."""

    def __init__(self, reason: object) -> None:
        super().__init__(str(reason))
        self.reason = reason


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


PAUSE_AT = 64  # buffered body chunks before the connection stops reading (the client is slower than the worker)


class Response:
    """One response: status and headers once they arrived, then the body as it comes (`next_data`)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future[bool] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expires = 0.0          # loop time the current wait gives up at
        self._error: BaseException | None = None
        self.complete = False
        self.closed = False

    @property
    def content_type(self) -> str:
        return self.headers.get(b"content-type", b"").decode("latin-1")

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    # -- fed by the connection
    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        if len(self._chunks) >= PAUSE_AT:
            self._conn.pause()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if error is not None and not self.complete and self._error is None:
            self._error = error
        self.complete = self.complete or error is None
        self._wake()
        self._stop_timer()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    async def _sleep(self, timeout_s: float) -> bool:
        """Until the connection has news (True) or `timeout_s` passed (False). One timer per response, not one per
        wait: a wait with a later deadline moves only the deadline, and the timer, when it fires before it, is set
        again for the rest; a wait with an earlier deadline sets the timer anew."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._expires = loop.time() + timeout_s
        if self._timer is None or self._timer.when() > self._expires:      # none, or set for a later deadline
            self._stop_timer()
            self._timer = loop.call_at(self._expires, self._on_timer)
        try:
            return await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return                                   # nobody waits now: the next wait sets it again
        loop = waiter.get_loop()
        # this wait began after the timer was set: set it again for the rest. Within the loop's clock resolution of
        # the deadline it has expired (asyncio runs a timer up to that early; re-arming there spun ~80 timers)
        if loop.time() + TIMER_SLACK_S < self._expires:
            self._timer = loop.call_at(self._expires, self._on_timer)
        else:
            _expire(waiter)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- used by the router
    def interrupt(self, reason: object) -> None:
        """Make the pending (or next) read raise `Interrupted(reason)`; the connection is not reused."""
        if self._error is None and not self.complete:
            self._error = Interrupted(reason)
            self._wake()

    async def wait_head(self, timeout_s: float) -> None:
        """Until the status line and headers arrived (raises the connection's error, or ReadTimeout)."""
        while self.status == 0:
            if self._error is not None:
                raise self._error
            if not await self._sleep(timeout_s):
                raise ReadTimeout(f"no response within {timeout_s:g} s")

    async def next_data(self, timeout_s: float) -> bytes | None:
        """Every body byte that arrived since the last call, as one piece (one wake-up, one piece: a worker that
        wrote a whole stream at once is read in one call, not event by event), or None at the end of the body."""
        chunks = self._chunks
        while not chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            if not await self._sleep(timeout_s):
                raise ReadTimeout(f"no data for {timeout_s:g} s")
        if self._error is not None and isinstance(self._error, Interrupted):
            raise self._error
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._conn.resume()
        return data

    async def read(self, timeout_s: float) -> bytes:
        parts = []
        while (data := await self.next_data(timeout_s)) is not None:
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Give the connection back when the body was read to its end, else close it (the worker sees that)."""
        if self.closed:
            return
        self.closed = True
        self._stop_timer()
        self._conn.done_with(self, reusable=self.complete and self._error is None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request at a time."""

    def __init__(self, origin: Origin) -> None:
        self._origin = origin
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.alive = True
        self.idle_since = 0.0
        self.requests = 0
        self._got_bytes = False
        self._keep_alive = True
        self._paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionLost(f"unparseable response from {self._origin.name}: {exc}",
                                      before_response=False, reused=self.requests > 1))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        if self.response is not None and not self.response.complete:
            before = self.response.status == 0
            why = f"{type(exc).__name__}: {exc}" if exc else "the worker closed the connection"
            state = "before answering" if before else "mid-response"
            self._fail(ConnectionLost(f"connection to {self._origin.name} lost {state} ({why})",
                                      before_response=before and not self._got_bytes, reused=self.requests > 1))
            # the worker dropped a request it held: its idle connections are suspect too (a killed process closes
            # them all, but their closes may reach this loop after a retry took one from the pool: the retry would
            # fail the same way, as a reused connection, until max_retries ran out, instead of connecting afresh
            # and finding the worker gone)
            self._origin.drop_idle()

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.response.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        self.response._wake()

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)

    def on_message_complete(self) -> None:
        self.response._finish()

    # -- the client
    def _fail(self, error: BaseException) -> None:
        if self.response is not None:
            self.response._finish(error)

    def send(self, head: bytes, body: bytes) -> Response:
        self.requests += 1
        self._got_bytes = False
        self.response = Response(self)
        try:
            self.transport.write(head + body)
        except RuntimeError as exc:  # uvloop: the transport closed under us (the worker went away while idle)
            self.alive = False
            self._fail(ConnectionLost(f"connection to {self._origin.name} lost before answering ({exc})",
                                      before_response=True, reused=self.requests > 1))
        return self.response

    def pause(self) -> None:
        if not self._paused and self.alive:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.alive:
            self._paused = False
            self.transport.resume_reading()

    def done_with(self, response: Response, reusable: bool) -> None:
        if response is not self.response:
            return
        self.response = None
        if reusable and self._keep_alive and self.alive:
            self.resume()
            self._origin.give_back(self)
        else:
            self.alive = False
            self.transport.close()


class Origin:
    """Connections to one worker (scheme http, host, port)."""

    def __init__(self, name: str, url: str, connect_timeout_s: float, keepalive_s: float, max_idle: int) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url!r}: the router's upstream client speaks plain http only")
        self.name = name
        self.host, self.port = parts.hostname, parts.port or 80
        self._host_header = f"{parts.hostname}:{self.port}".encode()
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []

    def give_back(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        if len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.alive = False
            conn.transport.close()

    def drop_idle(self) -> None:
        """Close every idle connection: the next request connects afresh."""
        while self._idle:
            conn = self._idle.pop()
            conn.alive = False
            conn.transport.close()

    def _take_idle(self) -> _Connection | None:
        limit = time.monotonic() - self._keepalive_s
        while self._idle:
            conn = self._idle.pop()
            # is_closing: closed but not yet told (connection_lost runs on a later loop turn), or the worker's
            # close went unnoticed while reading was paused: writing to it would fail (a decode killed and
            # restarted while this connection sat idle)
            if conn.alive and conn.idle_since > limit and not conn.transport.is_closing():
                return conn
            conn.alive = False
            conn.transport.close()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Connection(self), self.host, self.port),
                                             self._connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectFailed(f"{self.name} did not accept a connection within {self._connect_timeout_s:g} s") \
                from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.name}: {exc.strerror or exc}") from None
        return conn

    async def request(self, method: str, path: str, body: bytes = b"") -> Response:
        """Send one request; returns at once (the response's head arrives later: `Response.wait_head`)."""
        conn = self._take_idle() or await self._connect()
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            method.encode(), path.encode(), self._host_header, len(body))
        return conn.send(head, body)

    def close(self) -> None:
        self.drop_idle()
