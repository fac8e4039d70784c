"""The admin API (`docs/router_admin.md`): the orchestrator and operators list, drain and resume workers
and report their state changes. Every route needs `Authorization: Bearer <admin_token>`; without a
configured token the routes answer 403, so the API is never open by default. The token is never logged.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from dsv4_cluster.core import WorkerState

from .errors import Forbidden, Unauthorized
from .state import RouterState

log = logging.getLogger(__name__)


class StateChange(BaseModel):
    """Body of `POST /admin/workers/{name}/state`."""

    model_config = ConfigDict(extra="forbid")

    state: WorkerState
    reason: str | None = None


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def require_admin(request: Request) -> RouterState:
    state: RouterState = request.app.state.router
    expected = state.settings.admin_token
    if expected is None:
        raise Forbidden("the admin API is closed: this router has no admin_token in its settings")
    given = bearer_token(request)
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized("the admin API needs 'Authorization: Bearer <admin_token>' with the router's admin token")
    return state


def admin_router() -> APIRouter:
    api = APIRouter(prefix="/admin")

    @api.get("/workers")
    async def workers(state: RouterState = Depends(require_admin)) -> dict:
        return {"workers": [w.entry() for w in state.pool.workers]}

    @api.post("/workers/{name}/state")
    async def set_state(name: str, change: StateChange, state: RouterState = Depends(require_admin)) -> dict:
        worker = state.pool.worker(name)
        if worker.state is not change.state:
            log.info("admin: %s state %s -> %s (%s)", worker.describe(), worker.state.value, change.state.value,
                     change.reason or "no reason given")
        if change.state is WorkerState.READY and worker.state is not WorkerState.READY:
            worker.ready_again()  # restarted and probed by its supervisor: pair it now (Worker.ready_again)
        worker.state, worker.reason = change.state, change.reason
        return worker.entry()

    @api.post("/workers/{name}/drain")
    async def drain(name: str, state: RouterState = Depends(require_admin)) -> dict:
        worker = state.pool.worker(name)
        if not worker.drained:
            log.info("admin: draining %s (%d in flight)", worker.describe(), worker.in_flight)
        worker.drained = True
        return worker.entry()

    @api.post("/workers/{name}/resume")
    async def resume(name: str, state: RouterState = Depends(require_admin)) -> dict:
        worker = state.pool.worker(name)
        if worker.drained:
            log.info("admin: resuming %s", worker.describe())
        worker.drained = False
        return worker.entry()

    return api
