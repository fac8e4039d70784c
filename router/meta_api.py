"""Endpoints the router answers itself: `/health`, `/v1/models` and `/v1/models/{id}` (API key checked), `/metrics`.

`/health` follows the pool: 200 while at least one prefill and one decode worker are eligible (READY,
not drained, passing the router's health checks), else 503. It reads the pool's standing and probes
nothing itself, so a load balancer polling it never adds load to the workers. It is unauthenticated, so it
shows counts per role, never worker names (those are on the admin API).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .admission import check_key
from .errors import ModelNotFound

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
            "prefill": {"eligible": sum(w.eligible for w in pool.prefill), "configured": len(pool.prefill)},
            "decode": {"eligible": sum(w.eligible for w in pool.decode), "configured": len(pool.decode)},
            "background_tasks": len(state.tasks),
        }
        return JSONResponse(body, status_code=200 if pool.ready else 503)

    def _models(request: Request) -> list[dict]:
        state: RouterState = request.app.state.router
        check_key(request.scope, state.settings.api_keys)
        names = [state.settings.model_name, *state.settings.model_aliases]
        # SGLang's ModelCard: root is the served name, max_model_len the context (null when the settings lack it)
        return [{"id": n, "object": "model", "created": state.created, "owned_by": "dsv4-cluster", "root": n,
                 "parent": None, "max_model_len": state.settings.context_length} for n in names]

    @api.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": _models(request)})

    @api.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        """OpenAI's retrieve-model: the model object, or 404 `model_not_found`."""
        found = [m for m in _models(request) if m["id"] == model_id]
        if not found:
            raise ModelNotFound(f"The model {model_id!r} does not exist; this router serves "
                                f"{[m['id'] for m in _models(request)]}")
        return JSONResponse(found[0])

    @api.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        state: RouterState = request.app.state.router
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return api
