"""Server-sent events as SGLang streams them: `data: <json>` events, ended by `data: [DONE]`.

The router relays decode's stream on event boundaries (never a partial event), so that it can end a
stream with an error event on a clean boundary and can see the `[DONE]` and `error` events that
tell it how a leg ended; what arrived together is relayed together (one search for the last boundary, one
write), and split into events only where one must be read (`[DONE]`, an error, logprobs, a migration).
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    """An SSE event carrying an OpenAI error body (docs/protocol.md, "Errors and aborts")."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Framer:
    """Cuts a byte stream into runs of complete events (each event ending in a blank line), chunk by chunk: `feed`
    returns everything up to the last event boundary it has as one piece (one search per chunk, however many events
    it holds), and keeps the rest. A partial event left when the stream breaks is never relayed: the client's
    stream ends on an event boundary."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        end = buffer.rfind(b"\n\n") + 2
        if end < 2:
            self._buffer = buffer
            return b""
        self._buffer = buffer[end:]
        return b"" if buffer[:end].isspace() else buffer[:end]


def events(run: bytes) -> list[bytes]:
    """The events of a run of complete events (as `Framer.feed` returns), each with its blank line; blank ones
    dropped."""
    return [e + b"\n\n" for e in run.split(b"\n\n") if e.strip()]


def first_event(run: bytes) -> bytes:
    """`events(run)[0]` without splitting the rest of the run."""
    start = 0
    while (end := run.find(b"\n\n", start)) >= 0 and not run[start:end].strip():
        start = end + 2
    return run[start:end] + b"\n\n" if end >= 0 else events(run[start:])[0]


def data_of(event: bytes) -> str:
    """The event's data field (multi-line data joined by newlines); '' if it has none."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", errors="replace")


def is_done(event: bytes) -> bool:
    return data_of(event).strip() == "[DONE]"


def error_in(event: bytes) -> dict[str, Any] | None:
    """The `error` object of an error event, or None for any other event."""
    if b'"error"' not in event:
        return None
    data = data_of(event).strip()
    if not data.startswith("{"):
        return None
    try:
        parsed = json.loads(data)
    except json.JSONDecodeError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed["error"]
    return None
