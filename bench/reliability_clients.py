"""Chat clients that classify how each request ended, for the reliability bench (`reliability.py`).

Every request ends in exactly one outcome:
  completed   200 and a whole answer: a JSON body with a choice and its finish_reason, or a stream of events
              with a finish_reason and `data: [DONE]`;
  errored     an explicit error: a non-200 status with the OpenAI error envelope (message), or a stream that
              carries an error event and then `data: [DONE]`;
  reset       the connection was refused or closed under the client (only acceptable when the router itself
              was killed: nobody is left to send an error);
  left        the client hung up on purpose mid-stream (the soak's disconnecting clients);
  hung        no end within the client's deadline;
  lost        anything else: a 200 without a whole answer, an error event without `[DONE]`, a stream that
              stops without `[DONE]`, an error status without a message.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

MODEL = "dsv4-tiny"


@dataclass(frozen=True)
class Outcome:
    kind: str
    ended: float          # monotonic time the request ended (or was given up on)
    started: float
    detail: str = ""
    tokens: int = 0

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    out = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def _error_status(status: int, raw: bytes) -> tuple[str, str]:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "lost", f"HTTP {status} without an error message: {raw[:120]!r}"
    return ("errored", f"HTTP {status}: {message}"[:300]) if message else ("lost", f"HTTP {status}, empty message")


def _plain(status: int, raw: bytes) -> tuple[str, str, int]:
    if status != 200:
        return (*_error_status(status, raw), 0)
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        finished = choice["finish_reason"] is not None and isinstance(choice["message"]["content"], str)
        tokens = answer["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "lost", f"200 with a malformed body: {raw[:120]!r}", 0
    return ("completed", "", tokens) if finished else ("lost", "200 without a finish_reason", tokens)


class StreamState:
    """What one SSE stream carried so far."""

    def __init__(self) -> None:
        self.tokens, self.finished, self.error, self.done, self.malformed = 0, False, None, False, None

    def feed(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        data = line[6:]
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.malformed = data[:120]
            return
        if "error" in event:
            self.error = str(event["error"].get("message", event["error"]))[:300]
        for choice in event.get("choices", []):
            if choice.get("delta", {}).get("content"):
                self.tokens += 1
            if choice.get("finish_reason"):
                self.finished = True

    def outcome(self) -> tuple[str, str]:
        if self.malformed is not None:
            return "lost", f"malformed event: {self.malformed!r}"
        if self.error is not None:
            return ("errored", f"error event: {self.error}") if self.done else ("lost", "error event without [DONE]")
        if self.done and self.finished:
            return "completed", ""
        return "lost", f"stream ended without {'a finish_reason' if self.done else '[DONE]'} ({self.tokens} tokens)"


async def chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stream: bool,
               leave_after: int | None = None, on_token=None) -> Outcome:
    """One chat request through `url` (a router), classified. `leave_after`: hang up after that many tokens.
    `on_token()` is called at each streamed token (the fault runner waits for requests to be mid-stream)."""
    started = time.monotonic()

    def end(kind: str, detail: str = "", tokens: int = 0) -> Outcome:
        return Outcome(kind, time.monotonic(), started, detail, tokens)

    try:
        if not stream:
            r = await client.post(url + "/v1/chat/completions", json=body(prompt, max_tokens, False))
            return end(*_plain(r.status_code, r.content))
        state = StreamState()
        async with client.stream("POST", url + "/v1/chat/completions", json=body(prompt, max_tokens, True)) as r:
            if r.status_code != 200:
                return end(*_error_status(r.status_code, await r.aread()))
            async for line in r.aiter_lines():
                before = state.tokens
                state.feed(line)
                if state.tokens > before:
                    if on_token is not None:
                        on_token()
                    if leave_after is not None and state.tokens >= leave_after:
                        return end("left", f"hung up after {state.tokens} tokens", state.tokens)
        return end(*state.outcome(), state.tokens)
    except httpx.TimeoutException as exc:
        return end("hung", f"{type(exc).__name__}: no end within the client's timeout")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return end("reset", f"{type(exc).__name__}: {exc}"[:300])


def pct(values: list[float], p: float) -> float | None:
    """The p-th percentile (nearest rank) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]
