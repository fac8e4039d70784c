"""OpenAPI pieces for the generation routes, whose handlers read the raw body: `protocol.py`'s models as
self-contained JSON schemas, and the error envelope. The worker's and the router's `/openapi.json` use them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import protocol

ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message"],
                             "properties": {"message": {"type": "string"}}}},
}
ERROR_RESPONSE = {"description": "an error (OpenAI envelope)", "content": {"application/json": {"schema": ERROR}}}
MODELS = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
          "/generate": "GenerateRequest"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def request_schema(path: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of `path`'s body with every `$ref` inlined; `drop`: properties left out."""
    schema = getattr(protocol, MODELS[path]).model_json_schema()
    defs = schema.pop("$defs", {})
    schema = _inline(schema, defs)
    for field in drop:
        schema.get("properties", {}).pop(field, None)
    return schema


ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "rid")   # the router sets these itself
ROUTER_FILE = Path(__file__).resolve().parents[2] / "router" / "generation_schemas.json"


def router_schemas() -> dict[str, Any]:
    """What the router's OpenAPI document takes as the generation routes' bodies (the router never imports
    this module: the models pull in torch; it reads `router/generation_schemas.json`, written by `main`)."""
    return {"paths": {path: request_schema(path, ROUTER_FIELDS) for path in MODELS}, "error": ERROR}


def main() -> None:
    """`python -m dsv4_cluster.workers.http.openapi`: rewrite router/generation_schemas.json from the models."""
    ROUTER_FILE.write_text(json.dumps(router_schemas(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {ROUTER_FILE.name}")


def route_doc(path: str) -> dict[str, Any]:
    """`openapi_extra` of a worker's generation route."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": request_schema(path)}}},
            "responses": {"default": ERROR_RESPONSE}}


if __name__ == "__main__":
    main()
