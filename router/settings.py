"""Router settings: the JSON file the orchestrator writes and `python -m dsv4_cluster.router` reads.

Validated with pydantic (`extra="forbid"`) so that a typo in a field name or a bad URL fails at startup
with the field's path in the message, not at the first request. The CLI takes its defaults from here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .policies import DecodePolicy, Policy
from .prefix_policy import PrefixPolicy


class SettingsError(ValueError):
    """The settings file is missing, not JSON, or does not validate; the message names the field."""


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host; write it like 'http://127.0.0.1:30100'")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} must be the server's base URL, without a path, query or fragment")
    return url.rstrip("/")


class DecodeEndpoint(BaseModel):
    """One decode server: its HTTP URL."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    url: str

    _url = field_validator("url")(_check_url)


class PrefillEndpoint(DecodeEndpoint):
    """One prefill server: its HTTP URL and where decode servers reach its bootstrap server."""

    bootstrap_host: str = Field(min_length=1, description="P's host as reachable from the decode servers")
    bootstrap_port: int | None = Field(default=8998, ge=1, le=65535)


class RouterSettings(BaseModel):
    """Everything the router needs; the pools may be empty (then /health is 503 and requests get 503)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "0.0.0.0"
    port: int = Field(default=30001, ge=1, le=65535)
    model_name: str = Field(min_length=1)
    prefill: list[PrefillEndpoint] = Field(default_factory=list)
    decode: list[DecodeEndpoint] = Field(default_factory=list)
    request_timeout_s: float = Field(default=600.0, gt=0)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    admin_token: str | None = Field(
        default=None, min_length=16, repr=False,
        description="bearer token for /admin/*; without one the admin routes answer 403 (docs/router_admin.md)")
    health_check_interval_s: float = Field(default=2.0, gt=0, description="how often each worker's /health is polled")
    health_check_timeout_s: float = Field(default=2.0, gt=0)
    health_failures_to_unhealthy: int = Field(default=2, ge=1,
                                              description="consecutive failed checks before a worker leaves the pool")
    model_aliases: list[str] = Field(default_factory=list, description="other names clients may use for the model")
    api_keys: list[str] = Field(default_factory=list, repr=False,
                                description="if set, /v1/* and /generate need 'Authorization: Bearer <one of them>'")
    api_keys_file: str | None = Field(default=None, description="a file of API keys, one per line ('#' comments), "
                                      "added to api_keys when the settings are loaded")
    api_keys_env: str | None = Field(default=None, description="an environment variable holding API keys, "
                                     "comma-separated, added to api_keys when the settings are loaded")
    max_body_bytes: int = Field(default=32 * 2**20, ge=1024, description="larger request bodies get 413")
    request_head_timeout_s: float = Field(default=10.0, gt=0, description="a request head not complete this long "
                                          "after its first byte gets 408 and its connection closed (slowloris)")
    request_body_timeout_s: float = Field(default=30.0, gt=0, description="a request body not complete this long "
                                          "after its head gets 408 and its connection closed")
    max_queued_per_worker: int = Field(default=64, ge=0, description="a stage whose every eligible worker has this "
                                       "many requests queued for KV pages is saturated: new requests get 503 + "
                                       "Retry-After at once (backpressure.py); 0: off")
    stream_hold_s: float = Field(default=15.0, ge=0, description="a request whose prefill or decode died under it, "
                                 "with no other worker of that role that answers, is held this long for one (the "
                                 "supervisor restarts the dead one), tried at most once a second; 0: not held")
    migration_limit: int = Field(default=1, ge=0, description="times a stream whose decode died is continued on "
                                 "a fresh pair before it ends with an error event")
    prefill_policy: Policy = "round_robin"
    decode_policy: DecodePolicy = "round_robin"
    prefix: PrefixPolicy = Field(default_factory=PrefixPolicy, description="the prefill `prefix` policy's knobs")
    max_retries: int = Field(default=2, ge=0, description="fresh pairs tried after a connection-level failure that "
                             "happened before the first byte reached the client")
    breaker_failures: int = Field(default=5, ge=1, description="connection failures in a row that open a worker's "
                                  "circuit breaker")
    breaker_cooldown_s: float = Field(default=5.0, gt=0)
    upstream_keepalive_s: float = Field(default=4.5, gt=0, description="idle upstream connections are dropped after "
                                        "this; keep it below the workers' keep-alive (uvicorn: 5 s). Shorter costs "
                                        "a connect per request to workers that are seldom picked (many workers)")

    @model_validator(mode="after")
    def _names_unique(self) -> RouterSettings:
        names = [w.name for w in [*self.prefill, *self.decode]]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"worker names must be unique across prefill and decode; repeated: {dupes}")
        return self


def summary(settings: RouterSettings) -> list[str]:
    """What an operator checks before `up`: where the router listens, and its settings (never a key)."""
    keys = ("file " + settings.api_keys_file if settings.api_keys_file else
            "env " + settings.api_keys_env if settings.api_keys_env else
            f"{len(settings.api_keys)} inline" if settings.api_keys else "none (no key asked for)")
    return [f"listens on http://{settings.host}:{settings.port} (model {settings.model_name!r}; "
            f"prefill {[w.name for w in settings.prefill]}, decode {[w.name for w in settings.decode]})",
            f"policy: prefill {settings.prefill_policy}, decode {settings.decode_policy}; API keys: {keys}",
            f"admission: bodies up to {settings.max_body_bytes} bytes; timeouts: request "
            f"{settings.request_timeout_s:g} s, connect {settings.connect_timeout_s:g} s, request head "
            f"{settings.request_head_timeout_s:g} s, request body {settings.request_body_timeout_s:g} s"]


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def with_api_keys(settings: RouterSettings) -> RouterSettings:
    """`settings` with the keys of `api_keys_file` / `api_keys_env` added to `api_keys` (read now, in this
    process); SettingsError naming the file or variable when it cannot be read or holds no key."""
    keys, sources = list(settings.api_keys), []
    if settings.api_keys_file is not None:
        try:
            lines = Path(settings.api_keys_file).read_text().splitlines()
        except OSError as exc:
            raise SettingsError(f"cannot read the API keys file {settings.api_keys_file} (api_keys_file): "
                                f"{exc.strerror}") from exc
        sources.append((f"the API keys file {settings.api_keys_file}",
                        [s for line in lines if (s := line.split("#", 1)[0].strip())]))
    if settings.api_keys_env is not None:
        if settings.api_keys_env not in os.environ:
            raise SettingsError(f"the environment variable {settings.api_keys_env} (api_keys_env) is not set in the "
                                "router's environment; set it where the cluster is started")
        sources.append((f"the environment variable {settings.api_keys_env}",
                        [s for k in os.environ[settings.api_keys_env].split(",") if (s := k.strip())]))
    for where, found in sources:
        if not found:
            raise SettingsError(f"{where} holds no API key; put at least one there or drop the setting")
        keys += found
    return settings.model_copy(update={"api_keys": keys}) if sources else settings


def load_settings(path: str | Path) -> RouterSettings:
    """Read and validate a settings JSON file, API keys from their file or variable added; raise SettingsError
    naming the file and the bad fields."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise SettingsError(f"cannot read router settings {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise SettingsError(f"router settings {path} is not valid JSON: {exc}") from exc
    try:
        settings = RouterSettings.model_validate(raw)
    except ValidationError as exc:
        raise SettingsError(f"router settings {path} are invalid:\n{_describe(exc)}") from exc
    return with_api_keys(settings)
