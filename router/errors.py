"""Typed router errors and the one place that turns them into OpenAI-style error JSON.

Every failure a client can see leaves the router as `{"error": {"message", "type", "code"}}` with a
status that says whose fault it was: 400 the request, 502/503/504 an upstream worker, 500 the router.
Streams that already sent their 200 carry the same body as an SSE event (see `relay.py`). A RouterError has
two texts: `message` for the log (worker names, addresses, the worker's own words) and `public` for the client
(`public.py`: roles only); a client sees `public`, or `message` scrubbed when no public text was given.
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .public import scrub

log = logging.getLogger(__name__)


def error_body(message: str, type_: str, code: int | str) -> dict:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "code": code}}


class RouterError(Exception):
    """Base of every error the router reports to a client."""

    status: int = 500
    type_: str = "internal_error"
    headers: dict[str, str] | None = None

    def __init__(self, message: str, retryable: bool = False, code: str | None = None,
                 public: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.public = public  # the client's text (public.py); None: `message`, scrubbed
        self.retryable = retryable  # the worker cannot have started the request: another pair may take it
        self.code = code

    def body(self) -> dict:
        """What the client sees: the public text, never worker names or internal addresses (the log keeps them)."""
        return error_body(scrub(self.public or self.message), self.type_, self.code or self.status)


class InvalidRequest(RouterError):
    """The client's request cannot be routed as sent (bad JSON, wrong shape)."""

    status = 400
    type_ = "invalid_request_error"


class BodyTooLarge(RouterError):
    """The request body is over the router's `max_body_bytes`."""

    status = 413
    type_ = "invalid_request_error"


class ModelNotFound(RouterError):
    """The request names a model this router does not serve (OpenAI's 404 `model_not_found`)."""

    status = 404
    type_ = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="model_not_found")


class NoWorkers(RouterError):
    """A pool the request needs has no eligible worker: with Retry-After when one may come back (restarting,
    starting, stopped for a restart, failing health checks), without it when none does until an operator acts
    (FAILED, drained)."""

    status = 503
    type_ = "service_unavailable"

    def __init__(self, message: str, public: str | None = None, soon: bool = True) -> None:
        super().__init__(message, public=public)
        self.soon = soon
        self.headers = {"Retry-After": "1"} if soon else None


class Saturated(RouterError):
    """A stage's every eligible worker has a full queue: refused before any worker sees it (backpressure.py)."""

    status = 503
    type_ = "service_unavailable"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


class UnknownWorker(RouterError):
    """An admin request names a worker the router does not have."""

    status = 404
    type_ = "not_found_error"


class Unauthorized(RouterError):
    """A protected route was called without the right bearer token."""

    status = 401
    type_ = "authentication_error"
    headers = {"WWW-Authenticate": "Bearer"}


class Forbidden(RouterError):
    """A route that is closed on this router (the admin API without a configured admin token)."""

    status = 403
    type_ = "permission_error"


class UpstreamUnreachable(RouterError):
    """A worker could not be connected to, or dropped the connection."""

    status = 502
    type_ = "upstream_unreachable"


class UpstreamTimeout(RouterError):
    """A worker did not answer within the router's timeout."""

    status = 504
    type_ = "upstream_timeout"


class UpstreamFailed(RouterError):
    """A worker answered with an error. A client error (4xx) reaches the client with the worker's status and
    message; the worker's own failure reaches it as 502 (503 stays 503: capacity, retry later), never as a 500,
    which would say the router failed."""

    type_ = "upstream_error"

    def __init__(self, message: str, status: int, public: str | None = None, retryable: bool = False) -> None:
        super().__init__(message, retryable=retryable, public=public)
        self.status = status if status < 500 or status == 503 else 502
        if status == 503:
            self.headers = {"Retry-After": "1"}   # a worker out of capacity: soon again
        self.type_ = "invalid_request_error" if 400 <= status < 500 else "upstream_error"


def error_response(exc: RouterError) -> tuple[int, bytes, str, dict[str, str] | None]:
    """Status, body, content type and headers of the error response for `exc` (logged when it is the
    router's or a worker's fault)."""
    if exc.status >= 500:
        log.warning("%s (%d): %s", type(exc).__name__, exc.status, exc.message)
    return exc.status, json.dumps(exc.body()).encode(), "application/json", exc.headers


def _router_error(_: Request, exc: RouterError) -> Response:
    status, body, content_type, headers = error_response(exc)
    return Response(body, status_code=status, media_type=content_type, headers=headers)


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    body = error_body("invalid request: " + "; ".join(parts), InvalidRequest.type_, 400)
    return JSONResponse(body, status_code=400)


def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return JSONResponse(error_body(str(exc.detail), type_, exc.status_code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))   # e.g. 405's Allow


def unexpected(where: str, exc: BaseException) -> RouterError:
    """The catch-all: a router bug becomes a 500 in the OpenAI envelope with a request id; the exception and its
    traceback go to the log under that id, never to the client."""
    request_id = uuid.uuid4().hex[:16]
    log.error("unexpected error serving %s (request id %s)", where, request_id, exc_info=exc)
    return RouterError(f"unexpected {type(exc).__name__} serving {where} (request id {request_id})",
                       public=f"internal router error (request id {request_id}); the router's log has the details")


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    error = unexpected(f"{request.method} {request.url.path}", exc)
    return JSONResponse(error.body(), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to OpenAI-style error JSON."""
    app.add_exception_handler(RouterError, _router_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
