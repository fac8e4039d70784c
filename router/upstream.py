"""HTTP calls to one worker: a full call, an opened stream, and an abort by rid.

Every transport failure becomes a typed RouterError whose message names the worker and its URL,
so a client (and the operator reading the log) sees which server could not be reached.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from . import sse
from .errors import RouterError, UpstreamFailed, UpstreamTimeout, UpstreamUnreachable
from .pool import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LegResult:
    """One leg's complete answer; `error` is set when the leg failed (status, transport or error event)."""

    worker: Worker
    status: int
    content: bytes
    content_type: str
    error: RouterError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def upstream_message(content: bytes) -> str:
    """The human part of an upstream error body (OpenAI nested, SGLang flat, FastAPI detail, or text)."""
    try:
        parsed = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return content.decode("utf-8", errors="replace").strip()[:500] or "(empty body)"
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        for key in ("message", "detail", "error"):
            if key in parsed:
                return str(parsed[key])
    return json.dumps(parsed)[:500]


def transport_error(worker: Worker, exc: Exception, timeout_s: float) -> RouterError:
    """Map an httpx/asyncio failure to the error the client sees."""
    where = worker.describe()
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamUnreachable(f"{where} did not accept a connection in time: {exc!r}")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamUnreachable(f"cannot connect to {where}: {exc}")
    if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
        return UpstreamTimeout(f"{where} did not answer within {timeout_s:g} s (request_timeout_s)")
    return UpstreamUnreachable(f"{where} failed mid-request: {type(exc).__name__}: {exc}")


class Upstream:
    """The router's view of the workers over one shared httpx client."""

    def __init__(self, client: httpx.AsyncClient, request_timeout_s: float, abort_timeout_s: float) -> None:
        self.client = client
        self.request_timeout_s = request_timeout_s
        self.abort_timeout_s = abort_timeout_s

    def failed(self, worker: Worker, status: int, content: bytes) -> UpstreamFailed:
        return UpstreamFailed(f"{worker.describe()} answered {status}: {upstream_message(content)}", status)

    async def call(self, worker: Worker, path: str, body: dict[str, Any]) -> LegResult:
        """POST and read the whole answer (JSON, or SSE drained to the end); never raises for the leg."""
        try:
            resp = await asyncio.wait_for(self.client.post(worker.url + path, json=body), self.request_timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            return LegResult(worker, 0, b"", "", transport_error(worker, exc, self.request_timeout_s))
        content_type = resp.headers.get("content-type", "")
        result = LegResult(worker, resp.status_code, resp.content, content_type)
        if not resp.is_success:
            return LegResult(worker, resp.status_code, resp.content, content_type,
                             self.failed(worker, resp.status_code, resp.content))
        if content_type.startswith("text/event-stream"):
            return self._check_stream(result)
        return result

    def _check_stream(self, result: LegResult) -> LegResult:
        """A drained SSE answer fails if it carries an error event (streams keep HTTP 200)."""
        for chunk in result.content.replace(b"\r\n", b"\n").split(b"\n\n"):
            error = sse.error_in(chunk)
            if error is not None:
                status = error.get("code") if isinstance(error.get("code"), int) else 500
                message = f"{result.worker.describe()} streamed an error: {error.get('message', error)}"
                return LegResult(result.worker, result.status, result.content, result.content_type,
                                 UpstreamFailed(message, status))
        return result

    async def open_stream(self, worker: Worker, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST and return once the status line and headers arrived; the caller must close the response."""
        request = self.client.build_request("POST", worker.url + path, json=body)
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise transport_error(worker, exc, self.request_timeout_s) from exc

    async def abort(self, worker: Worker, rids: tuple[str, ...]) -> None:
        """Best effort `POST /abort_request` for each rid; failures are logged, never raised."""
        for rid in rids:
            try:
                abort = self.client.post(worker.url + "/abort_request", json={"rid": rid})
                resp = await asyncio.wait_for(abort, self.abort_timeout_s)
                if not resp.is_success:
                    log.warning("abort of %s on %s answered %d", rid, worker.describe(), resp.status_code)
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                log.warning("abort of %s on %s failed: %r", rid, worker.describe(), exc)
