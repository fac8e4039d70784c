"""Embedded prefill worker: the generation endpoints plus the bootstrap server decode talks to.

The bootstrap server (its own port, SGLang's default 8998) answers `/health` "OK" and `/route`
(the KV side's readiness probe), and takes decode's NIXL registration and per-room destinations.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ...core import Role
from ..args import WorkerArgs
from ..engine.runner import ModelRunner
from ..http.responses import GenSpec
from ..http.routes import build_app
from ..http.server import BadRequest, WorkerServer
from ..kv.transfer import NixlTransfer, PeerInfo, TransferError
from .engine import PrefillEngine


class Reserve(BaseModel):
    model_config = ConfigDict(extra="forbid")
    room: int
    agent_name: str
    pages: list[int]
    prompt: str | None = None   # destinations.prompt_digest of the decode's request
    waits_s: float | None = None   # decode's transfer timeout: no WRITE starts after it


class Cancel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    room: int


class PrefillServer(WorkerServer):
    role = Role.PREFILL

    def build_engine(self, runner: ModelRunner) -> PrefillEngine:
        a = self.args
        transfer = NixlTransfer(f"prefill-{a.node_address}-{a.port}", runner.pool, a.ucx_tls)
        return PrefillEngine(runner, transfer, peer_timeout_s=a.peer_timeout_s, chunk_tokens=a.chunked_prefill_size,
                             write_timeout_s=a.write_timeout_s, prefix_cache=not a.disable_radix_cache)

    def check(self, spec: GenSpec) -> None:
        if spec.room is None:
            raise BadRequest("bootstrap_room is required: a prefill server only serves requests paired by the "
                             "router (send requests to the router, not to the prefill worker)")

    def bootstrap_app(self) -> FastAPI:
        app = FastAPI(title="dsv4-cluster embedded prefill bootstrap server")

        @app.get("/health")
        async def health():
            return PlainTextResponse("OK")

        @app.get("/route")
        async def route(prefill_dp_rank: int = -1, prefill_cp_rank: int = -1, target_tp_rank: int = -1,
                        target_pp_rank: int = -1):
            if not self.ready:
                return PlainTextResponse("Prefill server not fully registered yet", status_code=503)
            a = self.args
            return {"tp_size": 1, "dp_size": 1, "cp_size": 1, "pp_size": 1, "page_size": a.page_size,
                    "kv_cache_dtype": self.engine.runner.pool.layout.dtype, "transfer_backend": a.transfer_backend,
                    "agent_name": self.engine.transfer.name}

        @app.post("/kv/register")
        async def register(info: dict):
            if not self.ready:
                return JSONResponse({"error": "prefill is still starting"}, status_code=503)
            try:
                peer = PeerInfo.from_json(info)
                await asyncio.to_thread(self.engine.transfer.add_peer, peer)
            except (TypeError, KeyError) as exc:
                return JSONResponse({"error": f"malformed registration: {exc}"}, status_code=400)
            except TransferError as exc:
                return JSONResponse({"error": str(exc)}, status_code=409)
            return {"agent_name": self.engine.transfer.name}

        @app.post("/kv/reserve")
        async def reserve(body: Reserve):
            if not self.ready:
                return JSONResponse({"error": "prefill is still starting"}, status_code=503)
            incarnation = self.engine.transfer.incarnation(body.agent_name)
            if incarnation is None:
                return JSONResponse({"error": f"unknown decode agent {body.agent_name}; register first"},
                                    status_code=409)
            if not self.engine.destinations.put(body.room, body.agent_name, body.pages, incarnation, body.prompt,
                                                body.waits_s):
                return JSONResponse({"error": f"bootstrap_room {body.room} was cancelled by decode"},
                                    status_code=410)
            return {"success": True}

        @app.post("/kv/cancel")
        async def cancel(body: Cancel):
            """Decode gave a room up; `in_flight` false means no KV will ever be written into its pages."""
            if not self.ready:
                return JSONResponse({"error": "prefill is still starting"}, status_code=503)
            return {"in_flight": self.engine.destinations.cancel(body.room)}

        return app


def make_apps(args: WorkerArgs) -> list[tuple[FastAPI, str, int]]:
    server = PrefillServer(args)
    return [(build_app(server), args.host, args.port),
            (server.bootstrap_app(), args.host, args.disaggregation_bootstrap_port)]
