"""The generation endpoints: each request is paired across a prefill and a decode worker.

`/v1/chat/completions`, `/v1/completions` and `/generate` share one path through the router; they
differ only in the field that must carry the prompt.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from .errors import InvalidRequest
from .exchange import exchange
from .pairing import pair_request
from .relay import relay
from .state import RouterState

log = logging.getLogger(__name__)

PROMPT_FIELDS = {
    "/v1/chat/completions": ("messages",),
    "/v1/completions": ("prompt",),
    "/generate": ("text", "input_ids", "input_embeds"),
}


def parse_body(raw: bytes, path: str) -> dict[str, Any]:
    """The JSON object of a generation request; InvalidRequest says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON ({exc}); send a JSON object") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    fields = PROMPT_FIELDS[path]
    if not any(body.get(f) is not None for f in fields):
        raise InvalidRequest(f"{path} needs {' or '.join(repr(f) for f in fields)} in the request body")
    return body


async def route(request: Request, path: str) -> Response:
    state: RouterState = request.app.state.router
    body = parse_body(await request.body(), path)
    pair = state.pool.pick()
    streaming = False
    try:
        req = pair_request(path, body, pair)
        log.debug("rid %s: %s -> %s + %s", req.rid, path, pair.prefill.name, pair.decode.name)
        if req.stream:
            response = await relay(state.upstream, state.tasks, req)
            streaming = isinstance(response, StreamingResponse)  # then the relay releases the pair at its end
            return response
        return await exchange(state.upstream, state.tasks, req, request.receive)
    finally:
        if not streaming:
            pair.release()


def generation_router() -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions")

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions")

    @api.post("/generate")
    async def generate(request: Request) -> Response:
        return await route(request, "/generate")

    return api
