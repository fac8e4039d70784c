"""Calls to the workers: a whole answer, an opened stream, an abort by rid, a health probe.

Every transport failure becomes a typed RouterError whose log message names the worker (role, name, what the
transport said) and whose public text names its role only (`public.py`), and says whether the request may be
retried on another pair: only when the worker cannot have started it (refused connection; a connection lost
before any byte of an answer). A worker's 5xx reaches the client as the role and the status; its 4xx (the
request's fault) in its own words, scrubbed of this router's worker names, hosts and ports.
The per-worker circuit breaker (`Worker.record`) hears of every such failure and every success.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from . import sse
from .errors import RouterError, UpstreamFailed, UpstreamTimeout, UpstreamUnreachable
from .http_client import ConnectFailed, ConnectionLost, Interrupted, Origin, ReadTimeout, Response, UpstreamError
from .pool import Worker, WorkerPool
from .metrics import RouterMetrics
from .public import Redactor, worker_text
from .settings import RouterSettings

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


def transport_error(worker: Worker, exc: UpstreamError, timeout_s: float) -> RouterError:
    """Map a client failure to the error the client sees; `retryable` when the worker started nothing."""
    where, role = worker.describe(), worker.role
    if isinstance(exc, ConnectFailed):
        return UpstreamUnreachable(str(exc), retryable=True, public=worker_text(role, "could not be reached"))
    if isinstance(exc, ReadTimeout):
        return UpstreamTimeout(f"{where} did not answer within {timeout_s:g} s (request_timeout_s)",
                               public=worker_text(role, f"did not answer within {timeout_s:g} s"))
    if isinstance(exc, ConnectionLost):
        return UpstreamUnreachable(str(exc), retryable=exc.before_response,
                                   public=worker_text(role, "dropped the connection"))
    return UpstreamUnreachable(f"{where} failed mid-request: {type(exc).__name__}: {exc}",
                               public=worker_text(role, "failed mid-request"))


def worker_failed(worker: Worker, status: int, message: str, redact: Redactor) -> UpstreamFailed:
    """A worker's error answer or error event: a 4xx is the request's fault, in the worker's own words (scrubbed);
    anything else is the worker's, said by role and status (the client sees 502/503; the log has its words).
    Retryable when the worker failed (5xx other than 503, which says "no room": the client gets it with
    Retry-After): nothing reached the client, so another pair may take the request."""
    if 400 <= status < 500:
        return UpstreamFailed(message, status, public=redact.scrub(message))
    what = "cannot take this request now; retry later" if status == 503 else f"failed this request ({status})"
    return UpstreamFailed(f"{worker.describe()} answered {status}: {message}", status,
                          public=worker_text(worker.role, what), retryable=status >= 500 and status != 503)


def event_status(error: dict) -> int:
    """The status an error event stands for: its integer `code` when it is an HTTP error status, else 500."""
    code = error.get("code")
    return code if isinstance(code, int) and 400 <= code < 600 else 500


def stream_error(worker: Worker, content: bytes, redact: Redactor) -> UpstreamFailed | None:
    """A drained SSE answer fails if it carries an error event (streams keep HTTP 200)."""
    if b'"error"' not in content:
        return None
    for chunk in content.replace(b"\r\n", b"\n").split(b"\n\n"):
        error = sse.error_in(chunk)
        if error is not None:
            return worker_failed(worker, event_status(error), str(error.get("message", error)), redact)
    return None


class Upstream:
    """The router's connections to every worker of the pool."""

    def __init__(self, pool: WorkerPool, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self.request_timeout_s = settings.request_timeout_s
        self.abort_timeout_s = settings.connect_timeout_s
        self.redact = Redactor([w.name for w in pool.workers], [w.url for w in pool.workers],
                               [w.bootstrap_host for w in pool.workers])
        self._origins = {w.name: Origin(w.describe(), w.url, settings.connect_timeout_s, settings.upstream_keepalive_s,
                                        max_idle=256) for w in pool.workers}

    def _record(self, worker: Worker, exc: UpstreamError) -> None:
        """A connection-level failure counts for the worker's breaker and the metrics; a timeout does not."""
        if isinstance(exc, (ConnectFailed, ConnectionLost)):
            race = isinstance(exc, ConnectionLost) and exc.reused and exc.before_response   # the keep-alive race
            worker.record(ok=False, gone=not race)
            self._metrics.connect_errors.labels(worker.name).inc()

    def transport_error(self, worker: Worker, exc: UpstreamError) -> RouterError:
        return transport_error(worker, exc, self.request_timeout_s)

    def failed(self, worker: Worker, status: int, content: bytes) -> UpstreamFailed:
        """A worker's error answer (`worker_failed`)."""
        return worker_failed(worker, status, upstream_message(content), self.redact)

    async def send(self, worker: Worker, path: str, body: bytes) -> Response:
        """POST, returning once the request is written (connecting first if no idle connection is left)."""
        try:
            return await self._origins[worker.name].request("POST", path, body)
        except UpstreamError as exc:
            self._record(worker, exc)
            raise transport_error(worker, exc, self.request_timeout_s) from None

    async def wait_head(self, worker: Worker, response: Response) -> None:
        """Until the status line and headers arrived; closes the response and raises a RouterError if not."""
        asked = time.monotonic()
        try:
            await response.wait_head(self.request_timeout_s)
        except UpstreamError as exc:
            response.close()
            self._record(worker, exc)
            raise transport_error(worker, exc, self.request_timeout_s) from None
        except BaseException:
            response.close()
            raise
        worker.record(ok=True, at=asked)

    async def open(self, worker: Worker, path: str, body: bytes) -> Response:
        """POST and return once the head arrived; the caller must `close()` the response."""
        response = await self.send(worker, path, body)
        await self.wait_head(worker, response)
        return response

    async def call(self, worker: Worker, path: str, body: bytes, response: Response | None = None) -> LegResult:
        """POST and read the whole answer (JSON, or SSE drained to the end); never raises for the leg."""
        try:
            response = response or await self.open(worker, path, body)
        except RouterError as exc:
            return LegResult(worker, 0, b"", "", exc)
        try:
            content = await response.read(self.request_timeout_s)
        except Interrupted as exc:
            return LegResult(worker, 0, b"", "", RouterError(f"{worker.describe()}: {exc}",
                                                             public=worker_text(worker.role, "was interrupted")))
        except UpstreamError as exc:
            self._record(worker, exc)   # a connection lost mid-answer: the worker may be gone (a held request waits)
            return LegResult(worker, 0, b"", "", transport_error(worker, exc, self.request_timeout_s))
        finally:
            response.close()
        content_type = response.content_type
        if not response.ok:
            return LegResult(worker, response.status, content, content_type,
                             self.failed(worker, response.status, content))
        if content_type.startswith("text/event-stream"):
            error = stream_error(worker, content, self.redact)
            if error is not None:
                return LegResult(worker, response.status, content, content_type, error)
        return LegResult(worker, response.status, content, content_type)

    async def abort(self, worker: Worker, rids: tuple[str, ...]) -> None:
        """Best effort `POST /abort_request` for each rid; failures are logged, never raised."""
        for rid in rids:
            response = None
            try:
                response = await self._origins[worker.name].request("POST", "/abort_request",
                                                                    json.dumps({"rid": rid}).encode())
                await response.wait_head(self.abort_timeout_s)
                await response.read(self.abort_timeout_s)
                if not response.ok:
                    log.warning("abort of %s on %s answered %d", rid, worker.describe(), response.status)
            except (UpstreamError, Interrupted) as exc:
                log.warning("abort of %s on %s failed: %s", rid, worker.describe(), exc)
            finally:
                if response is not None:
                    response.close()

    async def probe(self, worker: Worker, path: str, timeout_s: float) -> tuple[int, bytes]:
        """GET `path` (health checks); raises UpstreamError or asyncio.TimeoutError."""
        response = await self._origins[worker.name].request("GET", path)
        try:
            await response.wait_head(timeout_s)
            return response.status, await asyncio.wait_for(response.read(timeout_s), timeout_s)
        finally:
            response.close()

    def close(self) -> None:
        for origin in self._origins.values():
            origin.close()
