"""Endpoints the router answers itself: `/health` and `/v1/models`.

`/health` reports the router's own readiness (it has a prefill and a decode worker to pair); it does
not probe the workers, so a load balancer polling it never adds load to them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .state import RouterState


def meta_router() -> APIRouter:
    api = APIRouter()

    @api.get("/health")
    async def health(request: Request) -> JSONResponse:
        state: RouterState = request.app.state.router
        pool = state.pool
        body = {
            "status": "ok" if pool.ready else "no_workers",
            "model": state.settings.model_name,
            "prefill": [w.name for w in pool.prefill],
            "decode": [w.name for w in pool.decode],
            "background_tasks": len(state.tasks),
        }
        return JSONResponse(body, status_code=200 if pool.ready else 503)

    @api.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state: RouterState = request.app.state.router
        model = {"id": state.settings.model_name, "object": "model", "created": state.created,
                 "owned_by": "dsv4-cluster"}
        return JSONResponse({"object": "list", "data": [model]})

    return api
