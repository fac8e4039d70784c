"""The orchestrator's side of the router admin API (`docs/router_admin.md`): one admin token per cluster, kept in
the cluster record and never in a message or log; supervisors report state changes, `drain` drains.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from dsv4_cluster.core import WorkerState
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan, with_router_settings

TOKEN_BYTES = 32
logger = logging.getLogger(__name__)


class RouterAdminError(RuntimeError):
    """The router's admin API did not answer, or refused (the message names the route)."""


def new_admin_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def with_admin_token(router: LaunchPlan, token: str) -> LaunchPlan:
    """The router's plan with `admin_token` in the settings it carries."""
    if router.router_settings is None:
        raise ValueError(f"{router.name} is not the router's plan: it carries no router settings")
    return with_router_settings(router, router.router_settings.model_copy(update={"admin_token": token}))


@dataclass(frozen=True)
class RouterLink:
    """Where a supervisor reaches the router's admin API (plain data: it travels to Ray actors)."""

    base_url: str
    token: str = dataclasses.field(repr=False)

    @classmethod
    def for_router(cls, router: LaunchPlan, token: str) -> RouterLink:
        return cls(router.health_url.removesuffix("/health"), token)


class RouterAdmin:
    """A small synchronous client of the admin API."""

    def __init__(self, link: RouterLink, timeout_s: float = 5.0) -> None:
        self._link = link
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 2.0)),
                                  headers={"Authorization": f"Bearer {link.token}"})

    def _call(self, method: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = self._link.base_url + route
        try:
            r = self._http.request(method, url, json=body)
        except httpx.HTTPError as e:
            raise RouterAdminError(f"{method} {route}: the router at {self._link.base_url} does not "
                                   f"answer ({type(e).__name__})") from None
        if r.status_code != 200:
            raise RouterAdminError(f"{method} {route}: the router answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def workers(self) -> list[dict[str, Any]]:
        return self._call("GET", "/admin/workers")["workers"]

    def worker(self, name: str) -> dict[str, Any]:
        for entry in self.workers():
            if entry["name"] == name:
                return entry
        raise RouterAdminError(f"the router has no worker named {name!r}")

    def set_state(self, name: str, state: WorkerState, reason: str | None) -> dict[str, Any]:
        return self._call("POST", f"/admin/workers/{name}/state", {"state": state.value, "reason": reason})

    def drain(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"/admin/workers/{name}/drain")

    def resume(self, name: str) -> dict[str, Any]:
        return self._call("POST", f"/admin/workers/{name}/resume")

    def close(self) -> None:
        self._http.close()


def reason_line(error: str | None) -> str | None:
    """A state's reason as the router and the status history keep it: its first line, at most 300 characters."""
    return (error or "").split("\n")[0][:300] or None


class StateReporter:
    """Tells the router a worker's state unless it has it already; a failure waits for the next call
    (the router may not be up yet, or be restarting)."""

    def __init__(self, admin: RouterAdmin) -> None:
        self._admin = admin
        self._told: tuple[WorkerState, str | None] | None = None  # what the router acknowledged
        self._lock = threading.Lock()

    def report(self, name: str, read: Callable[[], tuple[WorkerState, str | None]], again: bool = False) -> None:
        """Tell the router the state `read()` returns, read under this reporter's lock so two callers
        never send out of order; `again`: even if the router has it, for a router that restarted and forgot."""
        with self._lock:
            state, error = read()
            current = (state, reason_line(error))
            if current == self._told and not again:
                return
            try:
                self._admin.set_state(name, *current)
            except RouterAdminError as e:
                logger.debug("router not told of %s %s yet: %s", name, state.value, e)
                return
            self._told = current
