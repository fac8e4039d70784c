"""The router's OpenAPI document (router/openapi.py): the generation routes' bodies are the embedded workers' models,
read from router/generation_schemas.json, which must be what those models give now."""

from __future__ import annotations

import json

from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.settings import RouterSettings
from dsv4_cluster.workers.http.openapi import ROUTER_FILE, router_schemas


def test_the_router_openapi_bodies_are_the_workers_models():
    """router/generation_schemas.json (the router reads it: the models pull in torch) equals what the models
    give now; regenerate with `python -m dsv4_cluster.workers.http.openapi`."""
    assert json.loads(ROUTER_FILE.read_text()) == json.loads(json.dumps(router_schemas())), \
        "router/generation_schemas.json is stale: run python -m dsv4_cluster.workers.http.openapi"
    doc = build_app(RouterSettings(model_name="m")).api.openapi()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in body["properties"] and "bootstrap_room" not in body["properties"]
