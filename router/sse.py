"""Server-sent events as SGLang streams them: `data: <json>` events, ended by `data: [DONE]`.

The router relays decode's stream event by event (never a partial event), so that it can end a
stream with an error event on a clean boundary and can see the `[DONE]` and `error` events that
tell it how a leg ended.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def error_event(body: dict[str, Any]) -> bytes:
    """An SSE event carrying an OpenAI error body (docs/protocol.md, "Errors and aborts")."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Framer:
    """Cuts a byte stream into complete events (each ending in a blank line), chunk by chunk. A partial event
    left when the stream breaks is never relayed: the client's stream ends on an event boundary."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buffer = self._buffer + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        out = []
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            if buffer[start:end].strip():
                out.append(buffer[start:end + 2])
            start = end + 2
        self._buffer = buffer[start:]
        return out


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
