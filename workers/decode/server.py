"""Embedded decode worker: reserves KV, registers with the request's prefill, streams tokens."""

from __future__ import annotations

import asyncio
import logging

import httpx
from fastapi import FastAPI

from ...core import Role
from ..args import WorkerArgs
from ..engine.request import Failed, Req, Reserved
from ..engine.runner import ModelRunner
from ..http.responses import GenSpec
from ..http.routes import build_app
from ..http.server import BadRequest, WorkerServer
from ..kv.transfer import NixlTransfer
from ..prefill.destinations import prompt_digest
from .engine import DecodeEngine

log = logging.getLogger(__name__)


class BootstrapError(RuntimeError):
    """The prefill's bootstrap server refused or could not be reached."""


class DecodeServer(WorkerServer):
    role = Role.DECODE

    def __init__(self, args: WorkerArgs):
        super().__init__(args)
        self._registered: set[str] = set()
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancels: set[asyncio.Task] = set()

    def build_engine(self, runner: ModelRunner) -> DecodeEngine:
        a = self.args
        transfer = NixlTransfer(f"decode-{a.node_address}-{a.port}", runner.pool, a.ucx_tls)
        engine = DecodeEngine(runner, transfer, self.tokenizer, transfer_timeout_s=a.transfer_timeout_s)
        engine.on_quarantine = self._quarantined
        return engine

    async def submit(self, spec: GenSpec):
        self._loop = asyncio.get_running_loop()
        return await super().submit(spec)

    def _quarantined(self, room: int, bootstrap: str | None) -> None:
        """Engine thread: a room's pages wait on prefill; ask it (on the server loop) to give them up."""
        if bootstrap is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._start_cancel, room, bootstrap)

    def _start_cancel(self, room: int, bootstrap: str) -> None:
        task = asyncio.create_task(self._cancel_room(room, bootstrap))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel_room(self, room: int, bootstrap: str, attempts: int = 10, pause_s: float = 1.0) -> None:
        """Free the room's pages now unless prefill may still write them (then its notification or
        the quarantine's expiry frees them). A prefill that is down or restarting holds no WRITE. An answer
        that settles nothing (the connection broke mid-call: a prefill dying, or a timeout) is asked again,
        `attempts` times `pause_s` apart: a restarted prefill answers, and the pages are not held until the
        quarantine expires (4 x --transfer-timeout-s)."""
        for attempt in range(attempts):
            try:
                r = await self.client().post(bootstrap + "/kv/cancel", json={"room": room})
                free = r.status_code == 503 or (r.status_code == 200 and not r.json().get("in_flight", True))
                break
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                free = True
                break
            except httpx.HTTPError as exc:
                free = False
                if attempt == attempts - 1:
                    log.warning("prefill %s did not answer the cancel of bootstrap_room %s: %r; its pages wait "
                                "for their quarantine to expire", bootstrap, room, exc)
                else:
                    await asyncio.sleep(pause_s)
        if free:
            self.engine.call(lambda: self.engine.release_quarantine(room))

    def check(self, spec: GenSpec) -> None:
        if spec.room is None or spec.bootstrap_host is None:
            raise BadRequest("a decode server cannot prefill: the request lacks bootstrap_host/bootstrap_port/"
                             "bootstrap_room; send it through the router, which pairs it with a prefill server")

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0))
        return self._client

    async def _tell_prefill(self, spec: GenSpec, pages: list[int]) -> None:
        base = spec.bootstrap_url
        body = {"room": spec.room, "agent_name": self.engine.transfer.name, "pages": pages,
                "prompt": prompt_digest(spec.prompt_ids), "waits_s": self.engine.transfer_timeout_s}
        try:
            for attempt in range(2):
                if base not in self._registered:
                    info = await asyncio.to_thread(lambda: self.engine.transfer.local_info().to_json())
                    r = await self.client().post(base + "/kv/register", json=info)
                    if r.status_code != 200:
                        raise BootstrapError(f"prefill bootstrap {base} refused registration: {r.text}")
                    self._registered.add(base)
                r = await self.client().post(base + "/kv/reserve", json=body)
                if r.status_code == 409 and attempt == 0:   # prefill restarted and forgot us
                    self._registered.discard(base)
                    continue
                if r.status_code != 200:
                    raise BootstrapError(f"prefill bootstrap {base} refused room {spec.room}: {r.text}")
                return
        except httpx.HTTPError as exc:
            raise BootstrapError(f"prefill bootstrap {base} unreachable: {exc!r}") from None

    async def on_reserved(self, spec: GenSpec, req: Req, ev: Reserved) -> Failed | None:
        try:
            await self._tell_prefill(spec, ev.pages)
        except BootstrapError as exc:
            self.engine.stats.bootstrap_failed += 1
            self.engine.abort(req.rid, str(exc))
            return Failed(500, f"KV bootstrap failed: {exc}")
        return None


def make_apps(args: WorkerArgs) -> list[tuple[FastAPI, str, int]]:
    return [(build_app(DecodeServer(args)), args.host, args.port)]
