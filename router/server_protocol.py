"""The router's HTTP/1.1 protocol: uvicorn's httptools protocol with deadlines on a request's head and body.

uvicorn bounds only the idle time between requests (keep-alive); a client that sends its request head or body one
byte at a time (slowloris) holds a connection for as long as it likes. Here a request's head must be complete within
`head_timeout_s` of its first byte (or of the connection), and its body within `body_timeout_s` of the head;
past either the router answers 408 (when no response has started) and closes the connection. Both come from
`RouterSettings` (`request_head_timeout_s`, `request_body_timeout_s`).

A request's cycle carries `on_lost`: the app sets it to be called when the connection is lost before the response
is complete, instead of keeping a task per request waiting on `receive()` for `http.disconnect`.

Each response's head also leaves in the same write as its first body piece (`HeadWithBody`): uvicorn writes them
apart, two system calls where one does, and on a short stream that write was a fifth of the router's time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
               b"content-length: %d\r\n\r\n%s")


class HeadWithBody:
    """A response's view of its connection: its first write (the head) is held until the next write of the same loop
    turn (the first body piece) and both go out as one; a held head goes out alone on the next loop turn, or before
    the connection closes. Everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held, self._flush = data, self._loop.call_soon(self.flush)
            return
        if self._held is not None:
            data, self._held = self._held + data, None
            self._flush.cancel()
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._flush.cancel()
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class DeadlineProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a deadline on each request's head, then on its body (see the module docstring)."""

    head_timeout_s = 10.0
    body_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, what: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            body = (b'{"error": {"message": "the request %s did not arrive within %g s", "type": '
                    b'"request_timeout", "code": 408}}' % (what.encode(), seconds))
            self.transport.write(TIMEOUT_408 % (len(body), body))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.head_timeout_s, "head")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.head_timeout_s, "head")

    def on_headers_complete(self) -> None:
        self._arm(self.body_timeout_s, "body")
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.cycle is not None:     # a new request's response (not an upgrade)
            self.cycle.transport = HeadWithBody(self.transport, self.loop)
            self.cycle.on_lost = None   # the app's callback for a connection lost mid-request (no watching task)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        if self.cycle is not None and self.cycle.disconnected and self.cycle.on_lost is not None:
            self.cycle.on_lost()


def protocol_class(head_timeout_s: float, body_timeout_s: float) -> type[DeadlineProtocol]:
    """A DeadlineProtocol subclass with these deadlines (uvicorn's `http=` takes a class)."""
    return type("DeadlineProtocol", (DeadlineProtocol,),
                {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s})
