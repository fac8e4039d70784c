"""The router's OpenAPI document (`GET /openapi.json`): FastAPI's routes plus the three generation routes.

The generation routes are plain ASGI (`generation.py`), so FastAPI does not see them; their request bodies are
the embedded workers' models (`workers/http/protocol.py`, written to `generation_schemas.json` by `python -m dsv4_cluster.workers.http.openapi`; SGLang 0.5.23's fields; the router sets the bootstrap fields
and `rid` itself and refuses them from clients), their answers the OpenAI shapes. Every operation documents its
errors as the OpenAI error envelope (`errors.py`): the status says whose fault, the body is always this shape.
Schemathesis runs against this document (`bench/reliability_input.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_CHOICES = {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"]}}
ANSWERS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion", "/generate": None}
SCHEMAS = Path(__file__).resolve().parent / "generation_schemas.json"


def _event_schema(obj: str | None, error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.2's event object): its data is `[DONE]`, or JSON: a chunk (the usage
    chunk too) or an error event."""
    chunk = ({"type": "object", "required": ["text", "meta_info"]} if obj is None else
             {"type": "object", "required": ["id", "object", "choices"], "properties": {"choices": {"type": "array"}}})
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def _answer_schema(obj: str | None) -> dict[str, Any]:
    if obj is None:   # SGLang's /generate: one object, or a list of them for a batch
        one = {"type": "object", "required": ["text", "meta_info"]}
        return {"oneOf": [one, {"type": "array", "items": one}]}
    return {"type": "object", "required": ["id", "object", "choices", "model"],
            "properties": {"object": {"const": obj}, "choices": _CHOICES}}


def _schemas() -> dict[str, Any]:
    """The bodies, from the file `python -m dsv4_cluster.workers.http.openapi` writes (importing the workers' models
    would pull torch into the router; a test keeps the file equal to the models)."""
    return json.loads(SCHEMAS.read_text())


def _error_response(error: dict[str, Any]) -> dict[str, Any]:
    return {"description": "an error (OpenAI envelope)", "content": {"application/json": {"schema": error}}}


def generation_paths() -> dict[str, Any]:
    schemas = _schemas()
    error = _error_response(schemas["error"])
    paths = {}
    for path, obj in ANSWERS.items():
        paths[path] = {"post": {
            "summary": f"{path}: paired across a prefill and a decode worker (docs/router.md)",
            "operationId": "generate" + path.replace("/", "_").replace(".", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": schemas["paths"][path]}}},
            "responses": {
                "200": {"description": "the answer; `stream: true` gives server-sent events ending in `data: [DONE]`",
                        "content": {"application/json": {"schema": _answer_schema(obj)},
                                    "text/event-stream": {"schema": _event_schema(obj, error[
                                        "content"]["application/json"]["schema"])}}},
                "default": error,
            },
        }}
    return paths


def install_openapi(api: FastAPI) -> None:
    """Replace FastAPI's document with one that has the generation routes and the error envelope."""

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            doc = get_openapi(title=api.title, version=api.version, routes=api.routes)
            doc["paths"].update(generation_paths())
            error = _error_response(_schemas()["error"])
            for item in doc["paths"].values():
                for op in item.values():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)   # validation errors are 400s with the envelope (errors.py)
                    responses.setdefault("default", error)
            api.openapi_schema = doc
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]
