"""`build_app(settings)`: the router's FastAPI app, one APIRouter per concern.

The upstream httpx client is created and closed in the lifespan; `trust_env=False` keeps proxy
variables of the environment from redirecting worker traffic.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
from fastapi import FastAPI

from .admin_api import admin_router
from .errors import install_error_handlers
from .health import HealthChecker
from .meta_api import meta_router
from .openai_api import generation_router
from .pool import WorkerPool
from .settings import RouterSettings
from .state import RouterState
from .tasks import TaskSet
from .upstream import Upstream

log = logging.getLogger(__name__)


def build_app(settings: RouterSettings) -> FastAPI:
    pool = WorkerPool(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s,
                                pool=settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            tasks = TaskSet()
            upstream = Upstream(client, settings.request_timeout_s, abort_timeout_s=settings.connect_timeout_s)
            app.state.router = RouterState(settings, pool, upstream, tasks, created=int(time.time()))
            log.info("router for %r serving on http://%s:%d (prefill: %s; decode: %s)", settings.model_name,
                     settings.host, settings.port, [w.name for w in pool.prefill], [w.name for w in pool.decode])
            if not pool.ready:
                log.warning("router has no prefill or no decode worker: /health is 503 until it has both")
            if settings.admin_token is None:
                log.info("no admin_token in the settings: the admin API answers 403")
            tasks.spawn(HealthChecker(pool, client, settings).run(), name="health-checks")
            try:
                yield
            finally:
                await tasks.aclose()

    app = FastAPI(title="dsv4-cluster router", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(generation_router())
    app.include_router(meta_router())
    app.include_router(admin_router())
    return app
