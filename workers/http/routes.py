"""The HTTP routes of an embedded worker (SGLang's worker endpoints) over a `WorkerServer`: health,
server/model info, metrics, abort, the three generation routes, and the `--test-hooks` fault routes."""

from __future__ import annotations

import asyncio

import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from ..engine.loop import EngineKilled
from .openapi import route_doc
from .protocol import AbortRequest
from .responses import error_response

if TYPE_CHECKING:
    from .server import WorkerServer


def build_app(server: WorkerServer) -> FastAPI:
    """The worker's app; its lifespan builds the engine after the socket listens (`WorkerServer.lifespan`)."""
    app = FastAPI(title=f"dsv4-cluster embedded {server.role} worker", lifespan=server.lifespan)
    app.state.exit_reason = lambda: server.exit_reason

    def need_ready():
        if server.ready:
            return None
        return error_response(503, "starting" if server.liveness is None else server.engine.fatal)

    @app.get("/health", response_class=PlainTextResponse)
    @app.get("/health_generate", response_class=PlainTextResponse)
    async def health():
        if (not_ready := need_ready()) is not None:
            return not_ready
        stall = await server.liveness.check()
        return error_response(503, stall) if stall else PlainTextResponse("OK")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return need_ready() or server.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return server.model_info()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.args.served_model_name, "object": "model",
                                            "created": 0, "owned_by": "dsv4-cluster",
                                            "root": f"dsv4-{server.args.model_preset}"}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return need_ready() or Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/abort_request")
    async def abort(body: AbortRequest):
        if server.engine is not None:
            server.engine.abort(body.rid, "aborted through /abort_request", finished=True)
        return {"success": True}

    @app.post("/flush_cache")
    async def flush_cache():
        """SGLang's: drop the prefix cache (here: every cached page no request holds; the prefill keeps the cache)."""
        engine = server.engine
        if engine is None or getattr(engine, "cache", None) is None:
            return {"success": True, "message": f"this {server.role} worker keeps no prefix cache"}
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        engine.call(lambda: loop.call_soon_threadsafe(done.set_result, engine.flush_cache()))
        freed = await asyncio.wait_for(done, 30)
        return {"success": True, "message": f"freed {freed} cached pages", "freed_pages": freed}

    if server.args.test_hooks:
        @app.post("/debug/kill_engine")
        async def kill_engine():
            if server.engine is None:
                return error_response(503, "starting")
            server.engine.call(_kill_engine)
            return {"success": True, "message": "the engine thread dies now (--test-hooks)"}

        @app.post("/debug/stall_engine")
        async def stall_engine(seconds: float = 20.0):
            """The engine thread stops for `seconds` while HTTP goes on: a hung engine (--test-hooks)."""
            if server.engine is None:
                return error_response(503, "starting")
            server.engine.call(lambda: time.sleep(seconds))
            return {"success": True, "message": f"the engine thread stalls for {seconds:g} s (--test-hooks)"}

    @app.post("/v1/chat/completions", openapi_extra=route_doc("/v1/chat/completions"))
    async def chat(request: Request):
        return await server.generate("chat", request)

    @app.post("/v1/completions", openapi_extra=route_doc("/v1/completions"))
    async def completions(request: Request):
        return await server.generate("completion", request)

    @app.post("/generate", openapi_extra=route_doc("/generate"))
    async def generate(request: Request):
        return await server.generate("generate", request)

    return app


def _kill_engine() -> None:
    raise EngineKilled("killed through POST /debug/kill_engine (--test-hooks)")

