"""`build_app(settings)`: the router's ASGI app.

The three generation routes are served as plain ASGI (`generation.py`); everything else (health, models,
metrics, admin) by a FastAPI app with one APIRouter per concern. The upstream connections, the health
checks and the background tasks are created and closed in the FastAPI app's lifespan.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from .admin_api import admin_router
from .errors import error_body, install_error_handlers
from .generation import PATHS as GENERATION_PATHS, is_generation, serve_generation
from .health import HealthChecker
from .meta_api import meta_router
from .metrics import RouterMetrics
from .openapi import install_openapi
from .pool import WorkerPool
from .settings import RouterSettings
from .state import RouterState
from .tasks import TaskSet
from .upstream import Upstream

log = logging.getLogger(__name__)


class RouterApp:
    """Generation POSTs to `serve_generation`, the rest (and the lifespan) to the FastAPI app. A request that carries
    an `Origin` header (a browser's) goes through CORS first, allowing every origin, method and header as SGLang's
    server does (its preflight `OPTIONS` answered there); the others skip it."""

    def __init__(self, api: FastAPI) -> None:
        self.api = api
        self.cors = CORSMiddleware(self.serve, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                                   allow_headers=["*"])

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and any(name == b"origin" for name, _ in scope["headers"]):
            await self.cors(scope, receive, send)
        else:
            await self.serve(scope, receive, send)

    async def serve(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_generation(scope):
            await serve_generation(self.api.state.router, scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in GENERATION_PATHS:     # a known path, another method
            body = error_body(f"{scope['method']} is not allowed on {scope['path']}; use POST",
                              "invalid_request_error", 405)
            await JSONResponse(body, status_code=405, headers={"Allow": "POST"})(scope, receive, send)
        else:
            await self.api(scope, receive, send)


def build_app(settings: RouterSettings) -> RouterApp:
    pool = WorkerPool(settings)
    metrics = RouterMetrics(pool)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = TaskSet()
        upstream = Upstream(pool, settings, metrics)
        app.state.router = RouterState(settings, pool, upstream, tasks, metrics, created=int(time.time()))
        log.info("router for %r serving on http://%s:%d (prefill: %s; decode: %s)", settings.model_name,
                 settings.host, settings.port, [w.name for w in pool.prefill], [w.name for w in pool.decode])
        if not pool.ready:
            log.warning("router has no prefill or no decode worker: /health is 503 until it has both")
        if settings.admin_token is None:
            log.info("no admin_token in the settings: the admin API answers 403")
        tasks.spawn(HealthChecker(pool, upstream, settings).run(), name="health-checks")
        gc.freeze()  # what startup built (FastAPI, pydantic, ...) never needs a scan: full collections stay short
        try:
            yield
        finally:
            await tasks.aclose()
            upstream.close()

    api = FastAPI(title="dsv4-cluster router", lifespan=lifespan)
    install_error_handlers(api)
    install_openapi(api)
    api.include_router(meta_router())
    api.include_router(admin_router())
    return RouterApp(api)
